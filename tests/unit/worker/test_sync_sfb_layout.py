"""SFB's factors rebuild autograd's gradient; the node layout and its bad input."""

from __future__ import annotations

import pytest
import torch

from services.common.errors import ConfigError
from services.worker.config import TrainerConfig
from services.worker.models import build_model
from services.worker.sync import SyncConfig, node_layout, sfb_plan
from services.worker.sync.sfb import FactorTap, reconstruct, sfb_pays


def test_factors_rebuild_the_gradient_of_a_real_linear_backward() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(7, 5)
    head = torch.nn.Linear(5, 1)
    tap = FactorTap(layer)
    x = torch.randn(6, 7)
    loss = head(torch.tanh(layer(x))).pow(2).mean()
    loss.backward()
    assert tap.rows == 6 and tap.delta is not None and tap.a is not None
    weight, bias = reconstruct(tap.delta, tap.a)
    assert layer.weight.grad is not None and layer.bias.grad is not None
    assert float(layer.weight.grad.abs().max()) > 1e-3
    torch.testing.assert_close(weight, layer.weight.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(bias, layer.bias.grad, rtol=1e-5, atol=1e-7)


def test_a_layer_called_twice_or_in_evaluation_is_not_factored() -> None:
    layer = torch.nn.Linear(3, 3)
    tap = FactorTap(layer)
    with torch.no_grad():
        layer(torch.randn(2, 3))
    assert tap.calls == 0 and tap.a is None            # evaluation records nothing
    layer(layer(torch.randn(2, 3))).sum().backward()
    assert tap.calls == 2 and tap.rows > 2 * 3 * 3      # too many rows: the dense way
    tap.reset()
    tap.remove()
    layer(torch.randn(2, 3))
    assert tap.calls == 0


def test_sfb_pays_only_below_the_gradient_size() -> None:
    assert sfb_pays(1, 4, 4) and not sfb_pays(2, 4, 4)   # 8 < 16; 16 is not < 16


def test_sfb_never_pays_on_the_default_dlrm_at_batch_2048() -> None:
    model = build_model("dlrm", sparse_dims={f"C{i}": 16 for i in range(26)}, num_dense=13)
    plan = sfb_plan(model, 2048)
    assert len(plan) == 5 and not any(layer["sfb"] for layer in plan)
    assert any(layer["sfb"] for layer in sfb_plan(model, 8))   # but it does at tiny batches


def test_node_layout_blocks_consecutive_ranks() -> None:
    assert node_layout(4, 2) == [[0, 1], [2, 3]]
    assert node_layout(3, 1) == [[0], [1], [2]]


@pytest.mark.parametrize("world,k", [(4, 3), (4, 0), (4, True), (4, 2.0)])
def test_a_bad_node_size_is_refused(world: int, k: object) -> None:
    with pytest.raises(ConfigError, match="ranks_per_node"):
        node_layout(world, k)  # type: ignore[arg-type]


def test_bad_settings_of_the_new_strategies_are_refused() -> None:
    with pytest.raises(ConfigError, match="ranks_per_node"):
        SyncConfig(name="hierarchical", ranks_per_node=0)
    for name in ("hierarchical", "sfb"):
        with pytest.raises(ConfigError, match="uncompressed"):
            TrainerConfig(sync=name, dense_codec="fp16")
    assert TrainerConfig(sync="hierarchical", ranks_per_node=4).sync_config().params() == {
        "ranks_per_node": 4}
