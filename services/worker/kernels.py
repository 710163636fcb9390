"""CPU kernels (numba, GIL released) with exact gradients, as torch autograd Functions.

torch's CPU kernels for these shapes are slow: ``embedding_bag``'s backward sorts every id,
and DLRM's interaction as ``bmm`` of ``(n, D) @ (D, n)`` per sample runs at a few GFLOP/s
(and needs the vectors stacked, then concatenated again with the bottom MLP's output).
Each Function takes CPU float32 tensors; callers keep torch's ops for other devices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from numba import njit
from torch import Tensor

from services.common.kernel_arrays import array_1d, array_2d, pointer_rows, refs

__all__ = ["BagLayout", "DotInteraction", "PoolBags", "PooledFrom", "dot_interaction_cpu"]


@njit(cache=True, nogil=True, inline="always")
def _bag_bounds(offsets, bag, n):  # pragma: no cover - numba
    """``[lo, hi)``: where bag ``bag``'s ids sit among the ``n`` ids."""
    return offsets[bag], offsets[bag + 1] if bag + 1 < offsets.size else n


@njit(cache=True, nogil=True)
def _bags_forward(rows, inverse, offsets, mean, outs):  # pragma: no cover - numba
    """Bag ``k * B + b`` (``B`` rows per output) pools into ``outs[k, b]``: the sum (or mean)
    of ``rows[inverse[i]]`` over its ids (``outs`` is written whole)."""
    n = inverse.size
    size = offsets.size // outs.shape[0]
    for k in range(outs.shape[0]):
        out = outs[k]
        for b in range(size):
            lo, hi = _bag_bounds(offsets, k * size + b, n)
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
def _bags_backward(grads, inverse, offsets, mean, grad_rows):  # pragma: no cover - numba
    """``grad_rows[inverse[i]] += grads[k][b]`` over bag ``k * B + b``'s ids (divided by the
    bag's size for mean); ``grads``: the outputs' gradients (:func:`_tensor_refs`)."""
    n = inverse.size
    size = offsets.size // grads.shape[0]
    for k in range(grads.shape[0]):
        grad = array_2d(grads, k, 0, np.float32, grad_rows.shape[1])
        for b in range(size):
            lo, hi = _bag_bounds(offsets, k * size + b, n)
            if hi == lo:
                continue
            scale = np.float32(1.0) / np.float32(hi - lo) if mean else np.float32(1.0)
            for i in range(lo, hi):
                r = inverse[i]
                for d in range(grad_rows.shape[1]):
                    grad_rows[r, d] += grad[b, d] * scale


def _tensor_refs(tensors: Sequence[Tensor], shape: tuple[int, ...]) -> np.ndarray:
    """The tensors as a kernel's rows, one field each (:func:`pointer_rows`), for kernels
    that take any number of them under one compiled signature; a ValueError unless each is
    a contiguous CPU float32 tensor of ``shape``. The caller keeps the tensors for the
    kernel's call."""
    for k, t in enumerate(tensors):
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() \
                or tuple(t.shape) != shape:
            raise ValueError(f"tensor {k} is {t.dtype} {tuple(t.shape)} on {t.device}, "
                             f"contiguous {t.is_contiguous()}: a kernel reads a contiguous "
                             f"CPU float32 {shape}")
    return pointer_rows([(t.data_ptr(), t.numel()) for t in tensors])


def _zeros(shape: tuple[int, ...]) -> np.ndarray:
    """A zeroed float32 array, zeroed in this thread: ``torch.zeros`` of a row gradient's size
    fills in parallel, and the fill's threads wait for a core that the process's other
    threads hold (3.6 -> 0.8 ms of CPU a step to pool and take the rows' gradients back, 26
    tables of a 512 batch, on 2 busy cores)."""
    return np.zeros(shape, dtype=np.float32)


class PoolBags(torch.autograd.Function):
    """Bag pooling on CPU float32 tensors with numba kernels (GIL released): several times
    faster than ``embedding_bag``'s CPU kernels here, whose backward sorts every id.

    The bags split into ``parts`` outputs of equal size (one per feature pooled from the
    rows), each a tensor of its own: their gradients reach the backward kernel as they come,
    never stacked into one."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, inverse: Tensor, offsets: Tensor, mean: bool,
                parts: int) -> tuple[Tensor, ...]:
        if offsets.numel() % parts:
            raise ValueError(f"{offsets.numel()} bags do not split into {parts} parts")
        # one buffer, one tensor per part over it: torch.empty per part releases and takes
        # back the GIL each time, and another thread may hold it meanwhile (pooling 1.25 ->
        # 1.02 ms a step with the loop's and the shard's threads running)
        parted = np.empty((parts, offsets.numel() // parts, rows.shape[1]), dtype=np.float32)
        _bags_forward(rows.detach().numpy(), inverse.numpy(), offsets.numpy(), mean, parted)
        outs = tuple(torch.from_numpy(part) for part in parted)
        ctx.save_for_backward(inverse, offsets)
        ctx.mean, ctx.num_rows = mean, rows.shape[0]
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        inverse, offsets = ctx.saved_tensors
        grad = _zeros((ctx.num_rows, grads[0].shape[1]))
        kept = [g.contiguous() for g in grads]  # alive through the kernel's call
        _bags_backward(_tensor_refs(kept, tuple(grads[0].shape)), inverse.numpy(),
                       offsets.numpy(), ctx.mean, grad)
        return torch.from_numpy(grad), None, None, None, None


_LANES = 64  # samples a block of the interaction kernels, whose inner loops run across them
_MAX_UNROLLED_DIM = 32  # the forward's dim loop unrolls up to this dim (slower above: measured)


@njit(cache=True, nogil=True, inline="always")
def _load_block(vecs, b0, m, tb):  # pragma: no cover - numba
    """``tb[i, d, s] = vecs[i][b0 + s, d]`` for the block's ``m`` samples (``vecs``:
    :func:`_tensor_refs`): the vectors of a block of samples, sample innermost (lanes past
    ``m`` are zeroed). Each row of ``tb`` is written whole, gathered from a column of the
    vector (the other order, each sample's vector read whole and scattered over ``dim``
    rows, takes ~1.8x as long)."""
    for i in range(tb.shape[0]):
        v = array_2d(vecs, i, 0, np.float32, tb.shape[1])
        for d in range(tb.shape[1]):
            for s in range(m):
                tb[i, d, s] = v[b0 + s, d]
            for s in range(m, tb.shape[2]):
                tb[i, d, s] = 0.0


@njit(cache=True, nogil=True, inline="always")
def _pair_dots(tb, out, row0, col0, unrolled):  # pragma: no cover - numba
    """``out[row0 + c, col0 + s]``: the dot of vectors ``i > j`` (pair ``c`` in
    ``tril_indices`` order) of the block ``tb`` ``(n, dim, lanes)`` for lane ``s``. With
    ``unrolled`` (a tuple of ``dim`` items: the dim as a compile-time constant) the dim's loop
    unrolls and each dot sums in a register across a vector of lanes, else each multiply-add
    goes over the lanes into ``out``'s row (faster for dims above 32, whose loop would not
    unroll)."""
    n, dim, lanes = tb.shape
    row = row0
    for i in range(1, n):
        for j in range(i):
            if len(unrolled):
                for s in range(lanes):
                    acc = np.float32(0.0)
                    for d in range(len(unrolled)):
                        acc += tb[i, d, s] * tb[j, d, s]
                    out[row, col0 + s] = acc
            else:
                for s in range(lanes):
                    out[row, col0 + s] = tb[i, 0, s] * tb[j, 0, s]
                for d in range(1, dim):
                    for s in range(lanes):
                        out[row, col0 + s] += tb[i, d, s] * tb[j, d, s]
            row += 1


@njit(cache=True, nogil=True, fastmath=True)
def _interaction_forward(vecs, keep_first, blocks, out_t, unrolled):  # pragma: no cover
    """Column ``b`` of ``out_t`` (feature-major: ``(width, B)``): ``vecs[0][b]`` if
    ``keep_first``, then ``<vecs[i][b], vecs[j][b]>`` for ``i > j`` in ``tril_indices`` order
    (``vecs``: the ``n`` vectors ``(B, dim)`` as :func:`_tensor_refs` gives them).
    Samples go a block of ``lanes`` at a time, transposed into ``blocks[k]``
    ``(n, dim, lanes)``, sample innermost (kept for the backward), so that the multiply-adds
    run across the block's samples (SIMD; the lanes are a run-time size, so that the
    compiler vectorizes the loops rather than unrolling them), and so is each row of
    ``out_t`` written: a contiguous run of the block's samples. ``unrolled``: see
    :func:`_pair_dots`."""
    _, n, dim, lanes = blocks.shape
    size = out_t.shape[1]
    first = dim if keep_first else 0
    ob = np.empty((n * (n - 1) // 2, lanes), dtype=np.float32)
    for k in range(blocks.shape[0]):
        b0, tb = k * lanes, blocks[k]
        m = min(lanes, size - b0)
        _load_block(vecs, b0, m, tb)
        for d in range(first):
            for s in range(m):
                out_t[d, b0 + s] = tb[0, d, s]
        if m == lanes:  # the dots straight into their rows
            _pair_dots(tb, out_t, first, b0, unrolled)
            continue
        _pair_dots(tb, ob, 0, 0, unrolled)  # a last, partial block: its lanes through ob
        for c in range(ob.shape[0]):
            for s in range(m):
                out_t[first + c, b0 + s] = ob[c, s]


@njit(cache=True, nogil=True, inline="always")
def _pair_grads(tb, grad_t, b0, m, first, gb, g4):  # pragma: no cover - numba
    """Add the pairs' part of the block's gradients into ``gb`` ``(n, dim, lanes)``: vector
    ``i`` takes its pairs ``(i, j)`` four ``j`` at a time (their upstream rows copied into
    ``g4``): one read-modify-write of its gradient for four multiply-adds."""
    n, dim, lanes = tb.shape
    for i in range(1, n):
        col = first + i * (i - 1) // 2  # pair (i, 0)'s upstream row
        j = 0
        while j < i:
            step = 4 if j + 4 <= i else 1
            for e in range(step):
                for s in range(m):
                    g4[e, s] = grad_t[col + j + e, b0 + s]
            if step == 4:
                for d in range(dim):
                    for s in range(lanes):
                        x0, x1, x2, x3 = g4[0, s], g4[1, s], g4[2, s], g4[3, s]
                        gb[i, d, s] += (x0 * tb[j, d, s] + x1 * tb[j + 1, d, s]
                                        + x2 * tb[j + 2, d, s] + x3 * tb[j + 3, d, s])
                        ti = tb[i, d, s]
                        gb[j, d, s] += x0 * ti
                        gb[j + 1, d, s] += x1 * ti
                        gb[j + 2, d, s] += x2 * ti
                        gb[j + 3, d, s] += x3 * ti
            else:
                for d in range(dim):
                    for s in range(lanes):
                        gb[i, d, s] += g4[0, s] * tb[j, d, s]
                        gb[j, d, s] += g4[0, s] * tb[i, d, s]
            j += step


@njit(cache=True, nogil=True, fastmath=True)
def _interaction_backward(grad_t, blocks, keep_first, plain, grads, source, part, sources,
                          means):  # pragma: no cover - numba
    """The gradient w.r.t. each vector, from the upstream gradient ``grad_t`` (feature-major,
    as the forward's output) and the forward's ``blocks``, a block at a time (each upstream
    row read as a contiguous run of the block's samples). Vector ``i``'s goes to
    ``grads[plain[i], b]`` (written whole) where ``plain[i] >= 0``, else straight into the
    rows it was pooled from: bag ``part[i] * B + b`` of source ``k = source[i]`` (row ``k``
    of ``sources``: its ids ``inverse``, its bags' ``offsets`` into them and its rows'
    gradient, fields 0, 1 and 2; the mean's scale where ``means[k]``) adds it to the rows'
    gradient, with no ``(B, dim)`` gradient of the pooled vector made."""
    _, n, dim, lanes = blocks.shape
    size = grad_t.shape[1]
    first = dim if keep_first else 0
    gb = np.empty((n, dim, lanes), dtype=np.float32)
    g4 = np.zeros((4, lanes), dtype=np.float32)
    for k in range(blocks.shape[0]):
        b0 = k * lanes
        m = min(lanes, size - b0)
        gb[:] = 0.0
        for d in range(first):
            for s in range(m):
                gb[0, d, s] = grad_t[d, b0 + s]
        _pair_grads(blocks[k], grad_t, b0, m, first, gb, g4)
        for i in range(n):
            if plain[i] >= 0:
                out = grads[plain[i]]
                for s in range(m):
                    for d in range(dim):
                        out[b0 + s, d] = gb[i, d, s]
                continue
            src = source[i]
            inverse, bag0 = array_1d(sources, src, 0, np.int64), part[i] * size + b0
            offsets = array_1d(sources, src, 1, np.int64)
            rows = array_2d(sources, src, 2, np.float32, dim)
            for s in range(m):
                lo, hi = _bag_bounds(offsets, bag0 + s, inverse.size)
                if hi == lo:
                    continue
                scale = np.float32(1.0) / np.float32(hi - lo) if means[src] else np.float32(1.0)
                for t in range(lo, hi):
                    r = inverse[t]
                    for d in range(dim):
                        rows[r, d] += gb[i, d, s] * scale


@dataclass(frozen=True, slots=True, eq=False)
class BagLayout:
    """One :class:`PoolBags` call's inputs: the ``rows`` it pooled, the ids ``inverse`` (int64
    indices into the rows), the bags' ``offsets`` into them (int64; ``parts x B`` bags, part
    after part) and whether it took the ``mean``."""

    rows: Tensor
    inverse: np.ndarray
    offsets: np.ndarray
    mean: bool


@dataclass(frozen=True, slots=True, eq=False)
class PooledFrom:
    """Where a pooled ``(B, dim)`` tensor came from: output ``part`` (bags ``part * B`` to
    ``(part + 1) * B``) of the :class:`PoolBags` call of ``bags``."""

    bags: BagLayout
    part: int


@dataclass(frozen=True, slots=True)
class _Sources:
    """Where each of the interaction's ``n`` vectors comes from: ``plain[i]``, its index
    among the Function's plain inputs (-1: pooled), else bag part ``part[i]`` of
    :class:`PoolBags` call ``source[i]``, whose rows, ids, bag offsets and mode are
    ``rows[k]``, ``inverses[k]``, ``offsets[k]`` and ``means[k]``."""

    plain: np.ndarray
    source: np.ndarray
    part: np.ndarray
    rows: tuple[Tensor, ...]
    inverses: tuple[np.ndarray, ...]
    offsets: tuple[np.ndarray, ...]
    means: np.ndarray


_SOURCE_DTYPES = (np.int64, np.int64, np.float32)  # a source's ids, offsets, rows' gradient


def _sources(vecs: Sequence[Tensor], given: Sequence[PooledFrom | None]
             ) -> tuple[_Sources, list[Tensor]]:
    """The vectors' sources and the plain ones: vector ``i`` is pooled where ``given[i]``
    names the :class:`PoolBags` call it came out of, plain where it is None."""
    size, dim = vecs[0].shape
    calls: dict[int, int] = {}  # id of a call's BagLayout -> its index in ``layouts``
    layouts: list[BagLayout] = []
    plain, source, part = [], [], []
    inputs: list[Tensor] = []
    for i, (v, src) in enumerate(zip(vecs, given, strict=True)):
        k = -1
        if src is not None:
            bags = src.bags
            if v.shape != (size, dim) or bags.rows.shape[1] != dim \
                    or src.part < 0 or (src.part + 1) * size > bags.offsets.size:
                raise ValueError(f"sources[{i}]: a ({size}, {dim}) vector cannot be part "
                                 f"{src.part} of {bags.offsets.size} bags of rows "
                                 f"{tuple(bags.rows.shape)}")
            k = calls.get(id(bags), -1)
            if k < 0:
                k = calls[id(bags)] = len(layouts)
                layouts.append(bags)
        source.append(k)
        part.append(src.part if src is not None else 0)
        plain.append(-1 if k >= 0 else len(inputs))
        if k < 0:
            inputs.append(v)
    return _Sources(plain=np.array(plain, dtype=np.int64),
                    source=np.array(source, dtype=np.int64), part=np.array(part, dtype=np.int64),
                    rows=tuple(b.rows for b in layouts),
                    inverses=tuple(b.inverse for b in layouts),
                    offsets=tuple(b.offsets for b in layouts),
                    means=np.array([b.mean for b in layouts] or [False])), inputs


def dot_interaction_cpu(vecs: Sequence[Tensor], keep_first: bool,
                        sources: Sequence[PooledFrom | None] | None = None) -> Tensor:
    """:class:`DotInteraction` of CPU float32 ``vecs``. ``sources[i]``, where given and not
    None, is the :class:`PoolBags` call that ``vecs[i]`` is an output of, as it came out:
    with autograd on, its gradient goes straight into that call's rows (see there)."""
    given = sources if sources is not None and torch.is_grad_enabled() else [None] * len(vecs)
    found, inputs = _sources(vecs, given)
    values = [v.detach().contiguous() for v in vecs]
    return DotInteraction.apply(keep_first, found, values, *inputs, *found.rows)


class DotInteraction(torch.autograd.Function):
    """DLRM's interaction of ``n`` vectors ``(B, D)`` (CPU float32) in one kernel each way:
    ``(B, [D +] n(n-1)/2)``, the first vector itself when ``keep_first``, then the pairwise
    dots in ``tril_indices(n, n, -1)`` order. The forward copies the vectors once, into
    blocks of ``_LANES`` samples with the sample innermost, and keeps them for the backward;
    no concatenation with the first vector is made in either direction. The output is a
    transposed view of a feature-major ``(width, B)`` tensor: a Linear layer after it takes
    it as it is (BLAS reads either order), and hands back its gradient in the same order,
    which the backward reads a block of samples at a time.

    Its inputs are the plain vectors and the rows of the :class:`PoolBags` calls that pooled
    the others (``sources``; ``values``: every vector, contiguous): the gradient of a pooled
    vector goes straight into the rows' gradient, with no ``(B, D)`` tensor for it and no
    pass of the pooling's backward (which runs only where something else uses its
    output)."""

    @staticmethod
    def forward(ctx: Any, keep_first: bool, sources: _Sources, values: Sequence[Tensor],
                *inputs: Tensor) -> Tensor:
        size, dim = values[0].shape
        n = len(values)
        vecs = _tensor_refs(values, (size, dim))
        out_t = torch.empty(((dim if keep_first else 0) + n * (n - 1) // 2, size),
                            dtype=torch.float32)
        blocks = np.empty((-(-size // _LANES), n, dim, _LANES), dtype=np.float32)
        unrolled = (0,) * dim if dim <= _MAX_UNROLLED_DIM else ()
        _interaction_forward(vecs, keep_first, blocks, out_t.numpy(), unrolled)
        ctx.blocks, ctx.keep_first, ctx.sources = blocks, keep_first, sources
        ctx.num_plain = len(inputs) - len(sources.rows)
        return out_t.t()

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        blocks, sources = ctx.blocks, ctx.sources
        grad_t = grad_out.t()
        if grad_t.stride(1) != 1:  # a row-major upstream: one transposing copy
            grad_t = grad_t.contiguous()
        grads = torch.empty((ctx.num_plain, grad_out.shape[0], blocks.shape[2]),
                            dtype=torch.float32)
        grad_rows = [_zeros(tuple(rows.shape)) for rows in sources.rows]
        source_refs = np.array([refs(arrays, _SOURCE_DTYPES) for arrays in zip(
            sources.inverses, sources.offsets, grad_rows, strict=True)],
            dtype=np.int64).reshape(len(grad_rows), 2 * len(_SOURCE_DTYPES))
        _interaction_backward(grad_t.numpy(), blocks, ctx.keep_first, sources.plain,
                              grads.numpy(), sources.source, sources.part, source_refs,
                              sources.means)
        return (None, None, None, *grads.unbind(0), *map(torch.from_numpy, grad_rows))
