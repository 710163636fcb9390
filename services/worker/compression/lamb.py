"""LAMB (You et al. 2020): Adam moments with a layer-wise trust ratio, for large-batch training.

Per parameter tensor (a "layer") at step t, with the gradient averaged over the ranks (the
dense sync does that, as for Adam)::

    m = β1·m + (1 − β1)·g;   v = β2·v + (1 − β2)·g²
    u = (m / (1 − β1^t)) / (sqrt(v / (1 − β2^t)) + ε) + λ·p        # Adam's step, weight decay λ
    r = clip(||p|| / ||u||, min_coeff, max_coeff)                   # 1 when either norm is 0
    p −= lr_t · r · u

so every layer moves by ``lr_t·||p||`` (while ``r`` is not clipped) whatever the scale of its
gradient: the trust ratio is what lets the batch (and the lr) grow without the layers whose
gradients are large running away. ``lr_t`` warms up linearly over ``warmup_steps`` and then
decays linearly to 0 at ``decay_steps`` (0: no decay), as in the paper's BERT runs.

Batch-size scaling (the large-batch papers' rule, LAMB's choice): when the batch grows k
times, scale the learning rate by ``sqrt(k)`` (:func:`sqrt_scaled_lr`), with a warm-up.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from services.common.errors import ConfigError, InvalidArgument

__all__ = ["Lamb", "check_float", "lr_factor", "sqrt_scaled_lr", "trust_ratio"]


def trust_ratio(p_norm: float, u_norm: float, min_coeff: float, max_coeff: float) -> float:
    """LAMB's ``clip(||p|| / ||u||, min_coeff, max_coeff)``; 1 when either norm is 0."""
    if p_norm > 0 and u_norm > 0:
        return min(max(p_norm / u_norm, min_coeff), max_coeff)
    return 1.0


def lr_factor(step: int, warmup_steps: int, decay_steps: int) -> float:
    """The fraction of the base lr used at 1-based ``step``: ``step / warmup_steps`` during the
    warm-up, then linear decay to 0 at ``decay_steps`` (constant when ``decay_steps`` is 0)."""
    if step <= warmup_steps:
        return step / warmup_steps
    if not decay_steps:
        return 1.0
    return max(0.0, 1.0 - (step - warmup_steps) / max(decay_steps - warmup_steps, 1))


def sqrt_scaled_lr(lr: float, batch: int, base_batch: int) -> float:
    """``lr`` tuned at ``base_batch`` samples per step, for ``batch``: ``lr·sqrt(batch/base)``."""
    if batch < 1 or base_batch < 1:
        raise ConfigError(f"batch sizes must be >= 1, got {batch} and {base_batch}")
    return lr * math.sqrt(batch / base_batch)


def check_float(name: str, value: Any, lo: float, hi: float, *, lo_open: bool = False) -> float:
    """``value`` as a float if it is a finite number in ``[lo, hi]`` (``(lo, hi]`` with
    ``lo_open``), else a ConfigError naming ``name``. The optimizers' settings check."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value > hi or value < lo or (lo_open and value == lo):
        raise ConfigError(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {value!r}")
    return float(value)


class Lamb(Optimizer):
    """LAMB (see the module doc). ``last_ratios`` holds each tensor's trust ratio of the last
    step and ``last_lr`` the lr it used."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, *, warmup_steps: int = 0,
                 decay_steps: int = 0, min_coeff: float = 0.01, max_coeff: float = 10.0
                 ) -> None:
        check_float("Lamb: lr", lr, 0.0, math.inf)
        for name, beta in zip(("beta1", "beta2"), betas, strict=True):
            check_float(f"Lamb: {name}", beta, 0.0, 1.0 - 1e-12)
        check_float("Lamb: eps", eps, 1e-30, 1.0)
        check_float("Lamb: weight_decay", weight_decay, 0.0, math.inf)
        check_float("Lamb: min_coeff", min_coeff, 1e-30, max_coeff)
        for name, steps in (("warmup_steps", warmup_steps), ("decay_steps", decay_steps)):
            if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
                raise ConfigError(f"Lamb: {name} must be an int >= 0, got {steps!r}")
        if decay_steps and decay_steps <= warmup_steps:
            raise ConfigError(f"Lamb: decay_steps ({decay_steps}) must be 0 or more than "
                              f"warmup_steps ({warmup_steps})")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps,
                                  "weight_decay": weight_decay, "min_coeff": min_coeff,
                                  "max_coeff": max_coeff})
        self.warmup_steps, self.decay_steps = warmup_steps, decay_steps
        self.step_count = 0
        self.last_ratios: list[float] = []
        self.last_lr = 0.0

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.step_count += 1
        t, factor = self.step_count, lr_factor(self.step_count, self.warmup_steps,
                                               self.decay_steps)
        self.last_ratios = []
        for group in self.param_groups:
            lr = self.last_lr = group["lr"] * factor
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                update = self._adam_update(p, p.grad, group, b1, b2, t)
                ratio = trust_ratio(float(p.norm()), float(update.norm()),
                                    group["min_coeff"], group["max_coeff"])
                self.last_ratios.append(ratio)
                p.add_(update, alpha=-lr * ratio)
        return loss

    def _adam_update(self, p: Tensor, grad: Tensor, group: dict[str, Any], b1: float,
                     b2: float, t: int) -> Tensor:
        """Update the moments of ``p`` and return Adam's bias-corrected step plus weight decay."""
        if grad.is_sparse:
            raise InvalidArgument("Lamb got a sparse gradient: embeddings live on the PS")
        st = self.state[p]
        if not st:
            st["exp_avg"] = torch.zeros_like(p)
            st["exp_avg_sq"] = torch.zeros_like(p)
        st["step"] = t
        m, v = st["exp_avg"], st["exp_avg_sq"]
        m.mul_(b1).add_(grad, alpha=1 - b1)
        v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
        update = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt_().add_(group["eps"]))
        if group["weight_decay"]:
            update.add_(p, alpha=group["weight_decay"])
        return update

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the moments and the step count (so the schedule goes on where it was)."""
        super().load_state_dict(state_dict)
        self.step_count = int(max((st.get("step", 0) for st in self.state.values()), default=0))
