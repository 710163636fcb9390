"""DCT-MP: per-sample thresholding of pooled activations, gradients only at kept positions."""

from __future__ import annotations

import pytest
import torch

from services.common.errors import ConfigError, InvalidArgument
from services.worker.compression import ActivationSparsifier, threshold_activations


def _x(rows: int = 6, width: int = 40) -> torch.Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(0),
                       requires_grad=True)


def test_keeps_each_samples_largest_magnitudes_in_fp16():
    x = _x()
    y = threshold_activations(x, 0.1)
    kept = y != 0
    assert kept.sum(dim=1).tolist() == [4] * 6
    top = torch.topk(x.detach().abs(), 4, dim=1).indices
    assert torch.equal(kept, torch.zeros_like(kept).scatter_(1, top, True))
    assert torch.equal(y[kept], x.detach()[kept].half().float())


def test_gradient_flows_only_through_kept_positions():
    x = _x()
    w = torch.randn(6, 40, generator=torch.Generator().manual_seed(1))
    y = threshold_activations(x, 0.25)
    (y * w).sum().backward()
    mask = y.detach() != 0
    assert torch.equal(x.grad, torch.where(mask, w.half().float(), torch.zeros_like(w)))


def test_keep_one_is_the_identity():
    x = _x()
    assert threshold_activations(x, 1.0) is x


def test_sparsifier_thresholds_across_features_and_counts_bytes():
    x = _x(8, 48)
    pooled = {"a": x[:, :16], "b": x[:, 16:]}
    sparse = ActivationSparsifier(0.05)
    out = sparse(pooled)
    assert list(out) == ["a", "b"] and out["a"].shape == (8, 16) and out["b"].shape == (8, 32)
    joined = torch.cat([out["a"], out["b"]], dim=1)
    assert (joined != 0).sum(dim=1).tolist() == [3] * 8  # ceil(0.05 · 48) over both features
    assert sparse.stats.raw_bytes == 8 * 8 * 48
    assert sparse.stats.ratio == pytest.approx(48 / 3)


@pytest.mark.parametrize("keep", [0, -0.1, 1.5, True, "0.1"])
def test_bad_keep_is_a_config_error(keep):
    with pytest.raises(ConfigError, match="activation keep"):
        ActivationSparsifier(keep)


def test_activations_must_be_two_dimensional():
    with pytest.raises(InvalidArgument, match="samples, width"):
        threshold_activations(torch.zeros(3), 0.5)
