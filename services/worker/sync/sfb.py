"""``sfb``: sufficient factor broadcasting (Xie et al. 2016) for the dense linear layers.

The weight gradient of ``y = a W^T + b`` over a batch is ``delta^T a`` (``delta`` = dL/dy,
``B x m``; ``a`` the input, ``B x n``) and the bias gradient ``delta.sum(0)``. Instead of the
``m x n`` gradient, each rank sends its ``B x (m + n)`` factors; every rank gathers all of
them and rebuilds the mean gradient ``sum_r delta_r^T a_r / N`` itself. That pays when
``B * (m + n) < m * n`` (wide layers, small per-rank batches): :func:`sfb_pays`. Layers where
it does not, and every other parameter, are averaged with one flat all-reduce as usual.

``B`` is the largest batch over the ranks (one tiny all-reduce a step; shorter batches are
padded with zero rows, which add nothing), so every rank takes the same decision. A layer
called more than once in a step goes the dense way.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from services.worker.sync.base import BaseSync, copy_flat_, dense_grads, flatten, mean_allreduce

__all__ = ["FactorTap", "SFBSync", "reconstruct", "sfb_pays", "sfb_plan"]

_DENSE = 1 << 40  # the row count that sends a layer the dense way (a second call in a step)


def sfb_pays(batch: int, m: int, n: int) -> bool:
    """True when ``batch`` samples' factors (``batch * (m + n)``) are fewer floats than the
    ``m x n`` gradient."""
    return batch * (m + n) < m * n


def reconstruct(delta: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
    """The (weight, bias) gradient of a linear layer from its factors ``(B, m)``, ``(B, n)``."""
    return delta.t() @ a, delta.sum(0)


class FactorTap:
    """Records a linear layer's sufficient factors of the last training forward/backward:
    its input rows ``a`` and the gradient ``delta`` of its output rows."""

    def __init__(self, layer: nn.Linear) -> None:
        self.layer = layer
        self.calls = 0
        self.a: Tensor | None = None
        self.delta: Tensor | None = None
        self._handle = layer.register_forward_hook(self._forward)

    def _forward(self, module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
        if not (torch.is_grad_enabled() and output.requires_grad):
            return  # evaluation
        self.calls += 1
        self.a = inputs[0].detach().reshape(-1, self.layer.in_features)
        output.register_hook(self._backward)

    def _backward(self, grad: Tensor) -> None:
        self.delta = grad.detach().reshape(-1, self.layer.out_features)

    @property
    def rows(self) -> int:
        """Sample rows of the step, or a huge count when the layer ran more than once."""
        return self.a.shape[0] if self.calls == 1 and self.a is not None else _DENSE

    def reset(self) -> None:
        self.calls, self.a, self.delta = 0, None, None

    def remove(self) -> None:
        self._handle.remove()


class SFBSync(BaseSync):
    """Gradient averaging every step; linear layers where it pays travel as factors."""

    name = "sfb"

    def __init__(self) -> None:
        super().__init__()
        self.taps: list[FactorTap] = []
        self.factor_layers = 0  # layers sent as factors in the last step

    def prepare(self, model: nn.Module) -> nn.Module:
        model = super().prepare(model)
        if self.active:
            self.taps = [FactorTap(m) for m in model.modules()
                         if isinstance(m, nn.Linear) and m.weight.requires_grad]
        return model

    def _on_backward(self, step: int) -> None:
        t0 = time.perf_counter()
        rows = torch.tensor([float(t.rows) for t in self.taps], dtype=torch.float64)
        if self.taps:
            dist.all_reduce(rows, op=dist.ReduceOp.MAX)
            self.stats.bytes_sent += rows.numel() * rows.element_size()
        factored = [(t, int(b)) for t, b in zip(self.taps, rows.tolist(), strict=True)
                    if sfb_pays(int(b), t.layer.out_features, t.layer.in_features)]
        self.factor_layers = len(factored)
        skip: set[int] = set()
        if factored:
            self._exchange_factors(factored)
            skip = {id(p) for t, _ in factored for p in t.layer.parameters()}
        grads = dense_grads([p for p in self.params if id(p) not in skip])
        if grads:
            flat = flatten(grads)
            copy_flat_(grads, mean_allreduce(flat, None, self.world_size))
            self._count_bytes(flat)
        for t in self.taps:
            t.reset()
        self.stats.sync_seconds += time.perf_counter() - t0

    def _exchange_factors(self, factored: list[tuple[FactorTap, int]]) -> None:
        """All-gather every rank's (padded) factors and write the mean gradients."""
        parts = []
        for tap, rows in factored:
            layer = tap.layer
            block = layer.weight.new_zeros(rows, layer.out_features + layer.in_features)
            if tap.delta is not None and tap.a is not None:
                block[:tap.a.shape[0], :layer.out_features] = tap.delta
                block[:tap.a.shape[0], layer.out_features:] = tap.a
            parts.append(block.reshape(-1))
        mine = torch.cat(parts)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(gathered, mine)
        self.stats.bytes_sent += mine.numel() * mine.element_size()
        offset = 0
        for tap, rows in factored:
            layer = tap.layer
            m, n = layer.out_features, layer.in_features
            blocks = torch.cat([g[offset:offset + rows * (m + n)].view(rows, m + n)
                                for g in gathered])
            offset += rows * (m + n)
            weight, bias = reconstruct(blocks[:, :m], blocks[:, m:])
            layer.weight.grad = weight.div_(self.world_size)
            if layer.bias is not None and layer.bias.requires_grad:
                layer.bias.grad = bias.div_(self.world_size)

    def _on_step(self, step: int) -> None:
        self.stats.syncs += 1

    def finish(self) -> bool:
        """Nothing to do: averaged gradients keep the replicas identical."""
        return False

    def close(self) -> None:
        for t in self.taps:
            t.remove()
        self.taps = []


def sfb_plan(model: nn.Module, batch: int) -> list[dict[str, Any]]:
    """Per linear layer of ``model``: its shape, the floats of its weight gradient and of
    ``batch`` samples' factors, and whether SFB sends the factors."""
    return [{"m": m.out_features, "n": m.in_features,
             "dense_floats": m.out_features * m.in_features,
             "factor_floats": batch * (m.out_features + m.in_features),
             "sfb": sfb_pays(batch, m.out_features, m.in_features)}
            for m in model.modules() if isinstance(m, nn.Linear)]
