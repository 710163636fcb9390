"""LAMB: the first step against hand-computed trust ratios, the per-layer update norm the trust
ratio fixes, the lr schedule and scaling rule, and bad settings."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from services.common.errors import ConfigError, InvalidArgument
from services.worker.compression import Lamb, lr_factor, sqrt_scaled_lr
from services.worker.config import TrainerConfig


def _toy() -> nn.Sequential:
    """A 2-layer toy: W1 = [[3, 0], [0, 4]] (norm 5), W2 = [[0.6, 0.8]] (norm 1)."""
    model = nn.Sequential(nn.Linear(2, 2, bias=False), nn.Linear(2, 1, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[3.0, 0.0], [0.0, 4.0]]))
        model[1].weight.copy_(torch.tensor([[0.6, 0.8]]))
    model[0].weight.grad = torch.tensor([[1e-3, -2e-3], [5e-4, -1e-3]])  # tiny gradients
    model[1].weight.grad = torch.tensor([[100.0, -300.0]])              # huge ones
    return model


def test_first_step_matches_hand_computed_trust_ratios() -> None:
    """Step 1 with bias correction: m̂ = g, v̂ = g², so Adam's step is sign(g) (ε ≈ 0).
    Layer 1 (no decay): u = sign(g1), ‖u‖ = 2, r = 5/2. Layer 2 (decay 0.5):
    u = sign(g2) + 0.5·W2 = [1.3, −0.6], ‖u‖ = √2.05, r = 1/√2.05."""
    model = _toy()
    opt = Lamb([{"params": [model[0].weight]},
                {"params": [model[1].weight], "weight_decay": 0.5}], lr=0.1, eps=1e-12)
    opt.step()
    assert opt.last_ratios == pytest.approx([2.5, 1 / math.sqrt(2.05)], rel=1e-6)
    torch.testing.assert_close(model[0].weight, torch.tensor([[2.75, 0.25], [-0.25, 4.25]]))
    r2 = 0.1 / math.sqrt(2.05)
    torch.testing.assert_close(model[1].weight, torch.tensor([[0.6 - 1.3 * r2, 0.8 + 0.6 * r2]]))


def test_trust_ratio_makes_each_layer_move_by_lr_times_its_norm() -> None:
    """Gradients 10^6 apart in scale: each layer still moves by lr·‖p‖ (plain Adam, or one
    ratio for the whole model, would not); clipped at max_coeff, by at most lr·max·‖u‖."""
    torch.manual_seed(0)
    model = _toy()
    opt = Lamb(model.parameters(), lr=0.01)
    capped = _toy()
    capped_opt = Lamb(capped.parameters(), lr=0.01, max_coeff=0.5)
    for _ in range(5):
        before = [p.detach().clone() for p in model.parameters()]
        capped_before = [p.detach().clone() for p in capped.parameters()]
        opt.step()
        capped_opt.step()
        for p, old in zip(model.parameters(), before, strict=True):
            assert float((p.detach() - old).norm()) == pytest.approx(0.01 * float(old.norm()), rel=1e-5)
        for p, old in zip(capped.parameters(), capped_before, strict=True):
            assert float((p.detach() - old).norm()) <= 0.01 * float(old.norm()) * (1 + 1e-6)
        assert capped_opt.last_ratios[0] == 0.5  # ‖W1‖/‖u‖ = 2.5 was clipped
        for m, scale in ((model, 1e-3), (capped, 1e-3)):
            m[0].weight.grad = scale * torch.randn(2, 2)
            m[1].weight.grad = 1e3 * torch.randn(1, 2)


def test_lr_warms_up_then_decays_to_zero() -> None:
    assert [lr_factor(t, 4, 10) for t in (1, 2, 4, 7, 10, 12)] == [0.25, 0.5, 1.0, 0.5, 0.0, 0.0]
    assert lr_factor(50, 4, 0) == 1.0 and lr_factor(1, 0, 0) == 1.0
    model = _toy()
    opt = Lamb(model.parameters(), lr=0.2, warmup_steps=4, decay_steps=10)
    lrs = []
    for _ in range(7):
        opt.step()
        lrs.append(opt.last_lr)
    assert lrs == pytest.approx([0.05, 0.1, 0.15, 0.2, 0.2 * 5 / 6, 0.2 * 4 / 6, 0.1])


def test_sqrt_scaling_rule() -> None:
    assert sqrt_scaled_lr(0.01, 512, 128) == pytest.approx(0.02)     # 4x the batch: 2x the lr
    assert sqrt_scaled_lr(0.01, 128, 128) == 0.01
    with pytest.raises(ConfigError, match="batch"):
        sqrt_scaled_lr(0.01, 0, 128)


@pytest.mark.parametrize("settings, match", [
    ({"lr": -1.0}, "lr"), ({"betas": (1.0, 0.999)}, "beta1"), ({"eps": 0.0}, "eps"),
    ({"warmup_steps": -1}, "warmup_steps"), ({"warmup_steps": 5, "decay_steps": 5}, "decay"),
    ({"max_coeff": 0.001}, "min_coeff")])
def test_bad_settings_are_config_errors(settings: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Lamb(_toy().parameters(), **settings)


def test_trainer_settings_of_lamb_are_checked() -> None:
    assert TrainerConfig(dense_optimizer="lamb", lamb_warmup_steps=5, lamb_decay_steps=50,
                         lamb_base_batch=128).lamb_base_batch == 128
    with pytest.raises(ConfigError, match="setting of dense_optimizer 'lamb'"):
        TrainerConfig(dense_optimizer="adam", lamb_warmup_steps=5)
    with pytest.raises(ConfigError, match="lamb_decay_steps"):
        TrainerConfig(dense_optimizer="lamb", lamb_warmup_steps=5, lamb_decay_steps=5)
    with pytest.raises(ConfigError, match="lamb_base_batch"):
        TrainerConfig(dense_optimizer="lamb", lamb_base_batch=-1)


def test_the_trainer_scales_lamb_lr_with_the_square_root_of_the_batch() -> None:
    from services.worker.dense_optimizers import make_optimizer

    config = TrainerConfig(dense_optimizer="lamb", lr=0.01, lamb_warmup_steps=3,
                           lamb_base_batch=128)
    opt = make_optimizer("lamb", nn.Linear(3, 1), config, batch=512)  # 4x: 2x the lr
    assert isinstance(opt, Lamb) and opt.param_groups[0]["lr"] == pytest.approx(0.02)
    assert opt.warmup_steps == 3
    with pytest.raises(ConfigError, match="give the batch"):
        make_optimizer("lamb", nn.Linear(3, 1), config)


def test_a_sparse_gradient_is_refused_and_changes_nothing() -> None:
    emb = nn.Embedding(4, 2, sparse=True)
    emb(torch.tensor([1])).sum().backward()
    before = emb.weight.detach().clone()
    with pytest.raises(InvalidArgument, match="sparse"):
        Lamb(emb.parameters()).step()
    assert torch.equal(emb.weight, before)
