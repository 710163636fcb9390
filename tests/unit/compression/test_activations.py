"""DCT-MP: thresholded pooled activations, tau reused between refreshes, gradients only at
kept positions, training only."""

from __future__ import annotations

import pytest
import torch

from services.common.errors import ConfigError, InvalidArgument
from services.worker.compression import ActivationSparsifier, threshold_activations
from services.worker.compression.activations import activation_threshold


def _x(rows: int = 6, width: int = 40, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    x = scale * torch.randn(rows, width, generator=torch.Generator().manual_seed(seed))
    return x.requires_grad_()


def test_threshold_keeps_the_largest_magnitudes_in_fp16():
    x = _x()
    tau = activation_threshold(x, 0.1)
    y = threshold_activations(x, tau)
    kept = y != 0
    assert int(kept.sum()) == 24  # ceil(0.1 · 240): the batch's quantile
    top = torch.topk(x.detach().abs().flatten(), 24).indices
    assert torch.equal(kept.flatten(), torch.zeros(240, dtype=torch.bool).scatter_(0, top, True))
    assert torch.equal(y[kept], x.detach()[kept].half().float())


def test_gradient_flows_only_through_kept_positions():
    x = _x()
    w = torch.randn(6, 40, generator=torch.Generator().manual_seed(1))
    y = threshold_activations(x, activation_threshold(x, 0.25))
    (y * w).sum().backward()
    mask = y.detach() != 0
    assert torch.equal(x.grad, torch.where(mask, w.half().float(), torch.zeros_like(w)))


def test_keep_one_is_the_identity():
    x = _x()
    assert activation_threshold(x, 1.0) == 0.0
    assert threshold_activations(x, 0.0) is x
    sparse = ActivationSparsifier(1.0)
    out = sparse({"a": x})
    assert torch.equal(out["a"], x)


def test_sparsifier_thresholds_across_features_and_counts_the_kept_bytes():
    x = _x(8, 48)
    pooled = {"a": x[:, :16], "b": x[:, 16:]}
    sparse = ActivationSparsifier(0.05)
    out = sparse(pooled)
    assert list(out) == ["a", "b"] and out["a"].shape == (8, 16) and out["b"].shape == (8, 32)
    kept = int((torch.cat([out["a"], out["b"]], dim=1) != 0).sum())
    assert kept == 20  # ceil(0.05 · 384) over both features
    assert sparse.stats.raw_bytes == 8 * 8 * 48 and sparse.stats.wire_bytes == 8 * kept


def test_tau_is_reused_between_refreshes_and_the_kept_share_stays_near_keep():
    """Recomputing tau every step (what the paper avoids) would make ``refreshes`` equal the
    steps; a tau never refreshed would keep nearly nothing once the activations grow."""
    sparse = ActivationSparsifier(0.1, refresh_every=10)
    shares = []
    for step in range(30):  # activations whose scale drifts slowly, then jumps at step 20
        x = _x(16, 32, seed=step, scale=(1 + 0.01 * step) * (8 if step >= 20 else 1))
        out = sparse({"a": x})["a"]
        shares.append(float((out != 0).float().mean()))
    assert sparse.refreshes in (3, 4)  # at steps 0, 10, 20 (and at most once for the jump)
    assert all(0.05 <= share <= 0.2 for share in shares), shares


def test_a_tau_kept_across_a_jump_is_refreshed_at_once():
    sparse = ActivationSparsifier(0.1, refresh_every=1000)
    sparse({"a": _x(16, 32)})
    out = sparse({"a": _x(16, 32, seed=1, scale=100.0)})["a"]  # tau of step 0 keeps nearly all
    assert sparse.refreshes == 2 and 0.05 <= float((out != 0).float().mean()) <= 0.2


@pytest.mark.parametrize("keep", [0, -0.1, 1.5, True, "0.1"])
def test_bad_keep_is_a_config_error(keep):
    with pytest.raises(ConfigError, match="activation keep"):
        ActivationSparsifier(keep)


@pytest.mark.parametrize("every", [0, -1, True, 1.5])
def test_bad_refresh_is_a_config_error(every):
    with pytest.raises(ConfigError, match="refresh_every"):
        ActivationSparsifier(0.5, refresh_every=every)


def test_activations_must_be_two_dimensional():
    with pytest.raises(InvalidArgument, match="samples, width"):
        threshold_activations(torch.zeros(3), 0.5)
