"""1-bit Adam and 1-bit LAMB: optimizers that do their own (compressed) gradient exchange.

Use them on a model that is *not* wrapped in DDP (or whose hook does nothing): during the
first ``freeze_step`` steps they all-reduce the gradients in fp32 and run ordinary Adam /
LAMB; afterwards the variance is frozen, each rank folds its *local* gradient into its
momentum and the momenta are averaged with the 1-bit two-phase
:func:`~services.worker.compression.collectives.compressed_allreduce` (worker and server
error feedback). Every rank must start from the same parameters and call ``step`` together;
a parameter without a gradient counts as a zero gradient so every rank sends the same layout.

**Dense parameters only.** Sparse gradients and modules holding ``nn.Embedding`` /
``nn.EmbeddingBag`` are refused: 1-bit compression cannot send an exact zero (sign(0) = +1,
so rows absent from a batch would still move by ±scale) and rows never seen have zero
variance, so the frozen-variance update ``m / (sqrt(v) + eps)`` explodes. Embeddings belong
on the parameter server with its own optimizer. Error buffers are per rank and are not saved:
``load_state_dict`` resets them (as DeepSpeed does).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from services.common.codecs.quant import ONEBIT_EMBEDDING_REFUSAL
from services.common.errors import ConfigError, InvalidArgument
from services.worker.compression.collectives import CommStats, OnebitReducer, world_of
from services.worker.compression.lamb import check_float, trust_ratio

__all__ = ["EMBEDDING_REFUSAL", "OnebitAdam", "OnebitLamb", "dense_parameters"]

EMBEDDING_REFUSAL = ONEBIT_EMBEDDING_REFUSAL


def dense_parameters(params: nn.Module | Iterable[Any], who: str) -> Any:
    """The parameters of a module with no embedding submodule (else ConfigError), or ``params``."""
    if isinstance(params, nn.Module):
        bad = [name or type(params).__name__ for name, m in params.named_modules()
               if isinstance(m, nn.Embedding | nn.EmbeddingBag)]
        if bad:
            raise ConfigError(f"{who} refuses embedding modules {bad}: {EMBEDDING_REFUSAL}")
        return [p for p in params.parameters() if p.requires_grad]
    return params


class _OnebitOptimizer(Optimizer):
    """Shared machinery: parameter checks, warm-up all-reduce, compressed momentum, counters."""

    def __init__(self, params: Any, defaults: dict[str, Any], *, freeze_step: int,
                 variance_floor: float, process_group: Any) -> None:
        who = type(self).__name__
        self.variance_floor = check_float(f"{who}: variance_floor", variance_floor, 0.0, 1.0)
        if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 1:
            raise ConfigError(f"{who}: freeze_step must be a positive int, got {freeze_step!r}")
        b1, b2 = defaults["betas"]
        check_float(f"{who}: lr", defaults["lr"], 0.0, math.inf)
        check_float(f"{who}: beta1", b1, 0.0, 1.0)
        if b1 >= 1.0:
            raise ConfigError(f"{who}: beta1 must be < 1, got {b1!r}")
        check_float(f"{who}: beta2", b2, 0.0, 1.0)
        check_float(f"{who}: eps", defaults["eps"], 0.0, math.inf, lo_open=True)
        check_float(f"{who}: weight_decay", defaults["weight_decay"], 0.0, math.inf)
        super().__init__(dense_parameters(params, who), defaults)
        self.freeze_step = freeze_step
        self.process_group = process_group
        self.reducer = OnebitReducer(group=process_group)
        self.stats = CommStats()
        self.step_count = 0

    @property
    def compressing(self) -> bool:
        """True once the warm-up is over (the next step uses the 1-bit all-reduce)."""
        return self.step_count >= self.freeze_step

    @property
    def wire_bytes(self) -> int:
        return self.stats.wire_bytes

    def _params(self) -> list[tuple[Tensor, dict[str, Any]]]:
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                elif p.grad.is_sparse:
                    raise InvalidArgument(f"{type(self).__name__} got a sparse gradient: "
                                          f"{EMBEDDING_REFUSAL}")
                out.append((p, group))
        return out

    def _allreduce_(self, tensors: list[Tensor]) -> None:
        """Average ``tensors`` over the ranks in fp32, in place (one flat all-reduce)."""
        flat = torch.cat([t.reshape(-1).float() for t in tensors])
        _, world = world_of(self.process_group)
        if world > 1:
            dist.all_reduce(flat, group=self.process_group)
            flat /= world
        self._unflatten_(flat, tensors)
        self.stats.add(4 * flat.numel(), 4 * flat.numel())

    def _compressed_mean_(self, tensors: list[Tensor]) -> None:
        """Replace ``tensors`` by their 1-bit compressed mean over the ranks, in place."""
        flat = torch.cat([t.reshape(-1).float() for t in tensors])
        before = self.reducer.stats.wire_bytes
        out = self.reducer.allreduce(flat, key="momentum")
        self._unflatten_(out, tensors)
        self.stats.add(4 * flat.numel(), self.reducer.stats.wire_bytes - before)

    @staticmethod
    def _unflatten_(flat: Tensor, tensors: list[Tensor]) -> None:
        offset = 0
        for t in tensors:
            t.copy_(flat[offset: offset + t.numel()].view_as(t))
            offset += t.numel()

    def _state(self, p: Tensor) -> dict[str, Any]:
        st = self.state[p]
        if not st:
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return st

    def _run(self, closure: Callable[[], Any] | None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = self._params()
        if params:
            self.step_count += 1
            if self.step_count <= self.freeze_step:
                self._allreduce_([p.grad for p, _ in params if p.grad is not None])
                self._warmup_step(params)
            else:
                if self.step_count == self.freeze_step + 1:
                    self._floor_variance(params)
                self._compressed_step(params)
            for p, _ in params:
                self.state[p]["step"] = self.step_count
        self.stats.steps += 1
        return loss

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        return self._run(closure)

    def _momentum_scales(self, params: list[tuple[Tensor, dict[str, Any]]]) -> None:
        """Fix each tensor's ``scaling_coeff = mean_q RMS(m_q) / RMS(m_p)`` (1-bit LAMB's; also
        used by 1-bit Adam): momenta are multiplied by it before the compressed all-reduce and
        divided after, so one sign scale fits layers whose momenta differ by orders of
        magnitude (else a quiet layer gets the loud ones' magnitude and diverges)."""
        rms = [float(self.state[p]["exp_avg"].norm()) / math.sqrt(max(p.numel(), 1))
               for p, _ in params]
        united = sum(rms) / len(rms)
        for (p, _), r in zip(params, rms, strict=True):
            self.state[p]["scaling_coeff"] = united / r if r > 0 and united > 0 else 1.0

    def _floor_variance(self, params: list[tuple[Tensor, dict[str, Any]]]) -> None:
        """Raise each tensor's frozen v to at least ``variance_floor · mean(v)``.

        Sign compression gives every coordinate the magnitude of the chunk's RMS, so a
        coordinate whose warm-up gradients were tiny (or zero: a dead ReLU unit) would move
        by ``lr · RMS / sqrt(v)`` per step and the model diverges after a short warm-up.
        ``variance_floor=0`` is DeepSpeed's behaviour.
        """
        if not self.variance_floor:
            return
        for p, _ in params:
            st = self._state(p)
            if p.numel():
                floor = self.variance_floor * float(st["exp_avg_sq"].mean())
                st["exp_avg_sq"].clamp_(min=floor)
                if "exp_avg_sq_fresh" in st:
                    st["exp_avg_sq_fresh"].clamp_(min=floor)

    def _warmup_step(self, params: list[tuple[Tensor, dict[str, Any]]]) -> None:
        raise NotImplementedError

    def _compressed_step(self, params: list[tuple[Tensor, dict[str, Any]]]) -> None:
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore moments and the step count; the per-rank error buffers start from zero."""
        super().load_state_dict(state_dict)
        steps = [st.get("step", 0) for st in self.state.values()]
        self.step_count = int(max(steps, default=0))
        self.reducer.reset()


class OnebitAdam(_OnebitOptimizer):
    """1-bit Adam (Tang et al. 2021): Adam warm-up, then frozen v and 1-bit momentum all-reduce.

    ``weight_decay`` is decoupled (added to the update, as in DeepSpeed). ``bias_correction``
    (default on) divides m and v by ``1 − β^t`` as torch's Adam does; v's correction is frozen
    with v. Two safeguards for short warm-ups, beyond DeepSpeed: each tensor's momentum is
    pre-scaled before the 1-bit all-reduce as 1-bit LAMB does (:meth:`_momentum_scales`), and
    ``variance_floor`` (default 0.01; 0 = off) bounds the frozen v from below per tensor
    (:meth:`_floor_variance`).
    """

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, freeze_step: int = 100,
                 bias_correction: bool = True, variance_floor: float = 0.01,
                 process_group: Any = None) -> None:
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    "bias_correction": bool(bias_correction)}
        super().__init__(params, defaults, freeze_step=freeze_step,
                         variance_floor=variance_floor, process_group=process_group)

    def _corrections(self, group: dict[str, Any], t: int) -> tuple[float, float]:
        if not group["bias_correction"]:
            return 1.0, 1.0
        b1, b2 = group["betas"]
        return 1.0 - b1 ** t, 1.0 - b2 ** min(t, self.freeze_step)

    def _apply(self, p: Tensor, group: dict[str, Any], m: Tensor, v: Tensor) -> None:
        c1, c2 = self._corrections(group, self.step_count)
        update = (m / c1) / ((v / c2).sqrt_().add_(group["eps"]))
        if group["weight_decay"]:
            update.add_(p, alpha=group["weight_decay"])
        p.add_(update, alpha=-group["lr"])

    def _warmup_step(self, params: list[tuple[Tensor, dict[str, Any]]]) -> None:
        for p, group in params:
            st = self._state(p)
            b1, b2 = group["betas"]
            st["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1)
            st["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
            self._apply(p, group, st["exp_avg"], st["exp_avg_sq"])

    def _compressed_step(self, params: list[tuple[Tensor, dict[str, Any]]]) -> None:
        if "scaling_coeff" not in self.state[params[0][0]]:
            self._momentum_scales(params)
        momenta = []
        for p, group in params:
            st = self._state(p)
            b1 = group["betas"][0]
            st["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1).mul_(st["scaling_coeff"])
            momenta.append(st["exp_avg"])
        self._compressed_mean_(momenta)
        for p, group in params:
            st = self.state[p]
            st["exp_avg"].div_(st["scaling_coeff"])
            self._apply(p, group, st["exp_avg"], st["exp_avg_sq"])


class OnebitLamb(_OnebitOptimizer):
    """1-bit LAMB (Li et al. 2021), following DeepSpeed's ``OnebitLamb``.

    Warm-up: LAMB with trust ratio ``c = clip(||p|| / ||u||, min_coeff, max_coeff)`` and
    ``c_freeze = coeff_beta·c_freeze + (1 − coeff_beta)·c``. Compression stage: the momenta,
    each pre-scaled by ``mean_q RMS(m_q) / RMS(m_p)`` (fixed at the first compressed step),
    go through one 1-bit all-reduce; ``g = (m − β1·m_prev)/(1 − β1)`` refreshes ``v_fresh``;
    the step is ``lr·c_freeze·f·u`` with ``f = max((sqrt(v)+eps)/(sqrt(v_fresh)+eps))``
    clipped to ``[factor_min, factor_max]`` and to ``±factor_threshold`` of its last value.
    ``last_factors`` holds each parameter's f of the last step.
    """

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, freeze_step: int = 100,
                 max_coeff: float = 10.0, min_coeff: float = 0.01, coeff_beta: float = 0.9,
                 factor_max: float = 4.0, factor_min: float = 0.5, factor_threshold: float = 0.1,
                 variance_floor: float = 0.01, process_group: Any = None) -> None:
        check_float("OnebitLamb: min_coeff", min_coeff, 0.0, max_coeff, lo_open=True)
        check_float("OnebitLamb: coeff_beta", coeff_beta, 0.0, 1.0)
        check_float("OnebitLamb: factor_min", factor_min, 0.0, 1.0, lo_open=True)
        check_float("OnebitLamb: factor_max", factor_max, 1.0, math.inf)
        check_float("OnebitLamb: factor_threshold", factor_threshold, 0.0, 1.0)
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    "max_coeff": max_coeff, "min_coeff": min_coeff}
        super().__init__(params, defaults, freeze_step=freeze_step,
                         variance_floor=variance_floor, process_group=process_group)
        self.coeff_beta = coeff_beta
        self.factor_max, self.factor_min = factor_max, factor_min
        self.factor_threshold = factor_threshold
        self.last_factors: list[float] = []
        self.last_coeffs: list[float] = []

    def _state(self, p: Tensor) -> dict[str, Any]:
        st = super()._state(p)
        st.setdefault("coeff_freeze", 0.0)
        st.setdefault("last_factor", 1.0)
        return st

    def _warmup_step(self, params: list[tuple[Tensor, dict[str, Any]]]) -> None:
        self.last_coeffs = []
        for p, group in params:
            st = self._state(p)
            b1, b2 = group["betas"]
            m, v = st["exp_avg"], st["exp_avg_sq"]
            m.mul_(b1).add_(p.grad, alpha=1 - b1)
            v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
            if self.step_count == self.freeze_step:
                st["exp_avg_sq_fresh"] = v.clone()
            update = m / (v.sqrt() + group["eps"])
            if group["weight_decay"]:
                update.add_(p, alpha=group["weight_decay"])
            p_norm, u_norm = float(p.norm()), float(update.norm())
            coeff = trust_ratio(p_norm, u_norm, group["min_coeff"], group["max_coeff"])
            if p_norm > 0 and u_norm > 0:
                st["coeff_freeze"] = (self.coeff_beta * st["coeff_freeze"]
                                      + (1 - self.coeff_beta) * coeff)
            self.last_coeffs.append(coeff)
            p.add_(update, alpha=-group["lr"] * coeff)

    def _compressed_step(self, params: list[tuple[Tensor, dict[str, Any]]]) -> None:
        first = params[0][0]
        if "scaling_coeff" not in self.state[first]:
            for p, _ in params:
                st = self._state(p)
                st.setdefault("exp_avg_sq_fresh", st["exp_avg_sq"].clone())
            self._momentum_scales(params)
        previous, momenta = [], []
        for p, group in params:
            st = self.state[p]
            b1 = group["betas"][0]
            previous.append(st["exp_avg"].clone())
            st["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1).mul_(st["scaling_coeff"])
            momenta.append(st["exp_avg"])
        self._compressed_mean_(momenta)
        self.last_factors, self.last_coeffs = [], []
        for (p, group), m_prev in zip(params, previous, strict=True):
            self._lamb_update(p, group, m_prev)

    def _lamb_update(self, p: Tensor, group: dict[str, Any], m_prev: Tensor) -> None:
        st = self.state[p]
        b1, b2 = group["betas"]
        m = st["exp_avg"].div_(st["scaling_coeff"])
        grad = (m - b1 * m_prev) / (1 - b1)
        st["exp_avg_sq_fresh"].mul_(b2).addcmul_(grad, grad, value=1 - b2)
        denom = st["exp_avg_sq"].sqrt() + group["eps"]
        prelim = m / denom
        update = prelim + group["weight_decay"] * p if group["weight_decay"] else prelim
        factor = float((denom / (st["exp_avg_sq_fresh"].sqrt() + group["eps"])).max())
        if group["weight_decay"]:
            u_norm = float(update.norm())
            ratio = min(1.0, float(prelim.norm()) / u_norm) if u_norm > 0 else 1.0
            factor = factor * ratio + (1.0 - ratio)
        factor = min(max(factor, self.factor_min), self.factor_max)
        last = st["last_factor"]
        factor = min(max(factor, last * (1 - self.factor_threshold)),
                     last * (1 + self.factor_threshold))
        st["last_factor"] = factor
        coeff = st["coeff_freeze"] * factor
        self.last_factors.append(factor)
        self.last_coeffs.append(coeff)
        p.add_(update, alpha=-group["lr"] * coeff)
