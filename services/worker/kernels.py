"""CPU kernels (numba, GIL released) with exact gradients, as torch autograd Functions.

torch's CPU kernels for these shapes are slow: ``embedding_bag``'s backward sorts every id,
and DLRM's interaction as ``bmm`` of ``(n, D) @ (D, n)`` per sample runs at a few GFLOP/s.
Each Function takes CPU float32 tensors; callers keep torch's ops for other devices.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from numba import njit
from torch import Tensor

__all__ = ["PairwiseDots", "PoolBags"]


@njit(cache=True, nogil=True)
def _bags_forward(rows, inverse, offsets, mean, out):  # pragma: no cover - numba
    """``out[b]`` = sum (or mean) of ``rows[inverse[i]]`` over bag ``b``'s ids (``out`` is
    written whole: it may come uninitialised)."""
    n = inverse.size
    for b in range(offsets.size):
        lo = offsets[b]
        hi = offsets[b + 1] if b + 1 < offsets.size else n
        for d in range(rows.shape[1]):
            out[b, d] = 0.0
        for i in range(lo, hi):
            r = inverse[i]
            for d in range(rows.shape[1]):
                out[b, d] += rows[r, d]
        if mean and hi > lo:
            scale = np.float32(1.0) / np.float32(hi - lo)
            for d in range(rows.shape[1]):
                out[b, d] *= scale


@njit(cache=True, nogil=True)
def _bags_backward(grad_out, inverse, offsets, mean, grad_rows):  # pragma: no cover - numba
    """``grad_rows[inverse[i]] += grad_out[b]`` (divided by the bag's size for mean)."""
    n = inverse.size
    for b in range(offsets.size):
        lo = offsets[b]
        hi = offsets[b + 1] if b + 1 < offsets.size else n
        if hi == lo:
            continue
        scale = np.float32(1.0) / np.float32(hi - lo) if mean else np.float32(1.0)
        for i in range(lo, hi):
            r = inverse[i]
            for d in range(grad_rows.shape[1]):
                grad_rows[r, d] += grad_out[b, d] * scale


class PoolBags(torch.autograd.Function):
    """Bag pooling on CPU float32 tensors with numba kernels (GIL released): several times
    faster than ``embedding_bag``'s CPU kernels here, whose backward sorts every id."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, inverse: Tensor, offsets: Tensor, mean: bool) -> Tensor:
        out = torch.empty((offsets.numel(), rows.shape[1]), dtype=rows.dtype)
        _bags_forward(rows.detach().numpy(), inverse.numpy(), offsets.numpy(), mean, out.numpy())
        ctx.save_for_backward(inverse, offsets)
        ctx.mean, ctx.num_rows = mean, rows.shape[0]
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None, None, None]:
        inverse, offsets = ctx.saved_tensors
        grad = torch.zeros((ctx.num_rows, grad_out.shape[1]), dtype=grad_out.dtype)
        _bags_backward(grad_out.contiguous().numpy(), inverse.numpy(), offsets.numpy(),
                       ctx.mean, grad.numpy())
        return grad, None, None, None


@njit(cache=True, nogil=True, fastmath=True)
def _dots_forward(t, li, lj, out):  # pragma: no cover - numba
    """``out[b, p] = <t[b, li[p]], t[b, lj[p]]>``."""
    for b in range(t.shape[0]):
        tb = t[b]
        for p in range(li.size):
            x, y = tb[li[p]], tb[lj[p]]
            s = np.float32(0.0)
            for d in range(x.size):
                s += x[d] * y[d]
            out[b, p] = s


@njit(cache=True, nogil=True, fastmath=True)
def _dots_backward(grad_out, t, li, lj, grad_t):  # pragma: no cover - numba
    """``grad_t[b, li[p]] += grad_out[b, p] * t[b, lj[p]]`` and symmetrically (``grad_t`` is
    written whole: it may come uninitialised)."""
    for b in range(t.shape[0]):
        tb, gb = t[b], grad_t[b]
        gb[:] = 0.0
        for p in range(li.size):
            w = grad_out[b, p]
            x, y, gx, gy = tb[li[p]], tb[lj[p]], gb[li[p]], gb[lj[p]]
            for d in range(x.size):
                gx[d] += w * y[d]
                gy[d] += w * x[d]


class PairwiseDots(torch.autograd.Function):
    """``(B, P)`` dots of the vectors ``t`` ``(B, n, D)`` at index pairs ``(li, lj)`` (int64)."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, li: Tensor, lj: Tensor) -> Tensor:
        t = t.detach().contiguous()
        out = torch.empty((t.shape[0], li.numel()), dtype=t.dtype)
        _dots_forward(t.numpy(), li.numpy(), lj.numpy(), out.numpy())
        ctx.save_for_backward(t, li, lj)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None, None]:
        t, li, lj = ctx.saved_tensors
        grad = torch.empty_like(t)
        _dots_backward(grad_out.contiguous().numpy(), t.numpy(), li.numpy(), lj.numpy(),
                       grad.numpy())
        return grad, None, None
