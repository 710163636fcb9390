"""Server-side optimizers for embedding rows: SGD, Adagrad, row-wise Adagrad, lazy Adam, FTRL.

Each optimizer updates a batch of *unique* rows in place, one compiled loop over the rows of
the batch, with float32 math (rows stored as float16 are widened by the caller first).
State lives per row next to the arena, in arrays indexed by slot:

=========  ==========================================================================
sgd        none
adagrad    ``accum`` (per element, starts at ``initial_accumulator``)
rowwise_   ``accum`` (one per row, starts at ``initial_accumulator``): TorchRec's default
adagrad    embedding optimizer; it adds the mean of the row's squared gradient, so the
           row moves by ``lr·g / (sqrt(accum) + eps)`` with one shared scale (1/dim the state)
adam       ``m``, ``v`` (per element) and ``step`` (per row: lazy Adam bias-corrects each
           row by the number of updates *it* received)
ftrl       ``z``, ``n`` (per element); the weight is a function of (z, n). ``z`` starts
           at the value whose weight is the row's initial value, so unseen rows keep it.
=========  ==========================================================================

FTRL-Proximal (McMahan et al. 2013), with ``alpha = lr``::

    sigma = (sqrt(n + g²) - sqrt(n)) / alpha;  z += g - sigma·w;  n += g²
    w = 0 if |z| <= l1 else -(z - sign(z)·l1) / ((beta + sqrt(n)) / alpha + l2)

``weight_decay`` (SGD, both Adagrads, Adam) adds ``weight_decay·w`` to a pushed row's gradient
before its update (L2 as TorchRec/FBGEMM apply it: lazily, only rows a push touches).
``grad_clip`` clips every element of a row's gradient to ``[-grad_clip, grad_clip]`` first (so
the update is the one of the clipped gradient, then checked for finite values as any).
``weight_bound`` clips every updated weight of every kind to ``[-bound, bound]``; rows
stored as float16 saturate at its largest finite value the same way. An update that would
leave a row's weights or optimizer state NaN or ±Inf (a finite but huge gradient: FTRL or
Adagrad with 1e20, SGD past float32's range) is refused for that row inside the kernel,
after the new values are computed and before any is written: the row and its state keep
their values, and the caller counts it (``refused_nonfinite``).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from services.common.kernel_arrays import array_1d, array_2d
from services.ps.prefetch import PREFETCH_DISTANCE as AHEAD
from services.ps.prefetch import prefetch, prefetch_row
from services.ps.tables import OptimizerConfig, OptimizerKind

__all__ = ["apply_update", "apply_updates", "init_state", "state_layout"]

_F32 = np.float32


def state_layout(config: OptimizerConfig, dim: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Per-row state arrays of ``config``: name → (shape of one row's state, dtype)."""
    per_elem = ((dim,), np.dtype(np.float32))
    if config.kind is OptimizerKind.ADAGRAD:
        return {"accum": per_elem}
    if config.kind is OptimizerKind.ROWWISE_ADAGRAD:
        return {"accum": ((), np.dtype(np.float32))}
    if config.kind is OptimizerKind.ADAM:
        return {"m": per_elem, "v": per_elem, "step": ((), np.dtype(np.int64))}
    if config.kind is OptimizerKind.FTRL:
        return {"z": per_elem, "n": per_elem}
    return {}


def init_state(config: OptimizerConfig, state: dict[str, np.ndarray], slots: np.ndarray,
               rows: np.ndarray) -> None:
    """Set the state of freshly created rows ``slots`` whose float32 values are ``rows``."""
    if config.kind in (OptimizerKind.ADAGRAD, OptimizerKind.ROWWISE_ADAGRAD):
        state["accum"][slots] = _F32(config.initial_accumulator)
    elif config.kind is OptimizerKind.ADAM:
        state["m"][slots] = 0.0
        state["v"][slots] = 0.0
        state["step"][slots] = 0
    elif config.kind is OptimizerKind.FTRL:
        c = _F32(config.ftrl_beta / config.lr + config.ftrl_l2)
        state["n"][slots] = 0.0
        state["z"][slots] = -(rows * c + np.sign(rows) * _F32(config.ftrl_l1))


@njit(cache=True, inline="always")
def _clip(w, bound):  # pragma: no cover - numba
    return min(max(w, -bound), bound)


@njit(cache=True, nogil=True)
def _sgd(W, wi, G, lr, wd, bound):  # pragma: no cover - numba
    """Returns the rows refused (their new values would not all be finite)."""
    n, dim = G.shape[0], G.shape[1]
    new = np.empty(dim, dtype=np.float32)
    refused = 0
    for k in range(n):
        if k + AHEAD < n:
            prefetch_row(W, wi[k + AHEAD])
        r = wi[k]
        ok = True
        for c in range(dim):
            w = W[r, c] - lr * (G[k, c] + wd * W[r, c])
            ok &= np.isfinite(w)
            new[c] = _clip(w, bound)
        if not ok:
            refused += 1
            continue
        for c in range(dim):
            W[r, c] = new[c]
    return refused


@njit(cache=True, nogil=True)
def _adagrad(W, wi, A, si, G, lr, eps, wd, bound):  # pragma: no cover - numba
    n, dim = G.shape[0], G.shape[1]
    new = np.empty((2, dim), dtype=np.float32)
    refused = 0
    for k in range(n):
        if k + AHEAD < n:
            prefetch_row(W, wi[k + AHEAD])
            prefetch_row(A, si[k + AHEAD])
        r = wi[k]
        s = si[k]
        ok = True
        for c in range(dim):
            g = G[k, c] + wd * W[r, c]
            a = A[s, c] + g * g
            w = W[r, c] - lr * g / (np.sqrt(a) + eps)
            ok &= np.isfinite(a) & np.isfinite(w)
            new[0, c] = a
            new[1, c] = _clip(w, bound)
        if not ok:
            refused += 1
            continue
        for c in range(dim):
            A[s, c] = new[0, c]
            W[r, c] = new[1, c]
    return refused


@njit(cache=True, nogil=True)
def _rowwise_adagrad(W, wi, A, si, G, lr, eps, wd, bound):  # pragma: no cover - numba
    n, dim = G.shape[0], G.shape[1]
    new = np.empty(dim, dtype=np.float32)
    refused = 0
    for k in range(n):
        if k + AHEAD < n:
            prefetch_row(W, wi[k + AHEAD])
            prefetch(A, si[k + AHEAD])
        r = wi[k]
        s = si[k]
        sq = np.float32(0.0)
        for c in range(dim):
            g = G[k, c] + wd * W[r, c]
            sq += g * g
        a = A[s] + sq / np.float32(dim)
        scale = lr / (np.sqrt(a) + eps)
        ok = np.isfinite(a)
        for c in range(dim):
            w = W[r, c] - scale * (G[k, c] + wd * W[r, c])
            ok &= np.isfinite(w)
            new[c] = _clip(w, bound)
        if not ok:
            refused += 1
            continue
        A[s] = a
        for c in range(dim):
            W[r, c] = new[c]
    return refused


@njit(cache=True, nogil=True)
def _adam(W, wi, M, V, T, si, G, lr, b1, b2, eps, wd, bound):  # pragma: no cover - numba
    one = np.float32(1.0)
    b1d = np.float64(b1)
    b2d = np.float64(b2)
    n, dim = G.shape[0], G.shape[1]
    new = np.empty((3, dim), dtype=np.float32)
    refused = 0
    for k in range(n):
        if k + AHEAD < n:
            prefetch_row(W, wi[k + AHEAD])
            prefetch_row(M, si[k + AHEAD])
            prefetch_row(V, si[k + AHEAD])
            prefetch(T, si[k + AHEAD])
        r = wi[k]
        s = si[k]
        t = T[s] + 1
        bc1 = np.float32(1.0 - b1d ** t)
        bc2 = np.float32(1.0 - b2d ** t)
        ok = True
        for c in range(dim):
            g = G[k, c] + wd * W[r, c]
            m = b1 * M[s, c] + (one - b1) * g
            v = b2 * V[s, c] + (one - b2) * g * g
            w = W[r, c] - lr * (m / bc1) / (np.sqrt(v / bc2) + eps)
            ok &= np.isfinite(m) & np.isfinite(v) & np.isfinite(w)
            new[0, c] = m
            new[1, c] = v
            new[2, c] = _clip(w, bound)
        if not ok:
            refused += 1
            continue
        T[s] = t
        for c in range(dim):
            M[s, c] = new[0, c]
            V[s, c] = new[1, c]
            W[r, c] = new[2, c]
    return refused


@njit(cache=True, nogil=True)
def _ftrl(W, wi, Z, N, si, G, alpha, beta, l1, l2, bound):  # pragma: no cover - numba
    zero = np.float32(0.0)
    n, dim = G.shape[0], G.shape[1]
    new = np.empty((3, dim), dtype=np.float32)
    refused = 0
    for k in range(n):
        if k + AHEAD < n:
            prefetch_row(W, wi[k + AHEAD])
            prefetch_row(Z, si[k + AHEAD])
            prefetch_row(N, si[k + AHEAD])
        r = wi[k]
        s = si[k]
        ok = True
        for c in range(dim):
            g = G[k, c]
            n_old = N[s, c]
            n_new = n_old + g * g
            sigma = (np.sqrt(n_new) - np.sqrt(n_old)) / alpha
            z = Z[s, c] + g - sigma * W[r, c]
            if abs(z) <= l1:
                w = zero
            else:
                w = -(z - np.sign(z) * l1) / ((beta + np.sqrt(n_new)) / alpha + l2)
            ok &= np.isfinite(z) & np.isfinite(n_new) & np.isfinite(w)
            new[0, c] = z
            new[1, c] = n_new
            new[2, c] = _clip(w, bound)
        if not ok:
            refused += 1
            continue
        for c in range(dim):
            Z[s, c] = new[0, c]
            N[s, c] = new[1, c]
            W[r, c] = new[2, c]
    return refused


@njit(cache=True, nogil=True)
def _adagrad_tables(tables, rows_at, accum_at, slots, G, starts, counts, lr, eps, wd, bound,
                    refused):  # pragma: no cover - numba
    """:func:`_adagrad` for each table ``t`` (a row of ``tables``: its rows and accumulator
    arrays at fields ``rows_at``, ``accum_at``): its rows ``slots[starts[t]:][:counts[t]]``
    (``refused[t]``: the rows it refused)."""
    dim = G.shape[1]
    for t in range(tables.shape[0]):
        lo, hi = starts[t], starts[t] + counts[t]
        refused[t] = _adagrad(array_2d(tables, t, rows_at, np.float32, dim), slots[lo:hi],
                              array_2d(tables, t, accum_at, np.float32, dim), slots[lo:hi],
                              G[lo:hi], lr, eps, wd, bound)


@njit(cache=True, nogil=True)
def _rowwise_adagrad_tables(tables, rows_at, accum_at, slots, G, starts, counts, lr, eps, wd,
                            bound, refused):  # pragma: no cover - numba
    """:func:`_rowwise_adagrad` for each table ``t`` (as :func:`_adagrad_tables`, one
    accumulator value a row): its rows ``slots[starts[t]:][:counts[t]]``."""
    dim = G.shape[1]
    for t in range(tables.shape[0]):
        lo, hi = starts[t], starts[t] + counts[t]
        refused[t] = _rowwise_adagrad(array_2d(tables, t, rows_at, np.float32, dim),
                                      slots[lo:hi], array_1d(tables, t, accum_at, np.float32),
                                      slots[lo:hi], G[lo:hi], lr, eps, wd, bound)


_TABLES_KERNELS = {OptimizerKind.ADAGRAD: _adagrad_tables,  # the kinds apply_updates serves
                   OptimizerKind.ROWWISE_ADAGRAD: _rowwise_adagrad_tables}


def _bound(config: OptimizerConfig, storage: np.dtype) -> np.float32:
    """The weight bound as the kernels take it: the configured one, within the largest
    finite value of the storage dtype (so float16 rows saturate instead of overflowing)."""
    top = float(np.finfo(storage).max)
    return _F32(top if config.weight_bound is None else min(config.weight_bound, top))


def _clipped(config: OptimizerConfig, grads: np.ndarray) -> np.ndarray:
    """``grads`` as float32, each element clipped to the table's ``grad_clip`` (if any)."""
    grads = np.ascontiguousarray(grads, dtype=np.float32)
    if config.grad_clip is None:
        return grads
    return np.clip(grads, _F32(-config.grad_clip), _F32(config.grad_clip))


def apply_update(config: OptimizerConfig, weights: np.ndarray, weight_index: np.ndarray,
                 state: dict[str, np.ndarray], slots: np.ndarray, grads: np.ndarray, *,
                 storage: np.dtype | type = np.float32) -> int:
    """Update ``weights[weight_index[k]]`` with ``grads[k]`` in place, state rows ``slots[k]``;
    returns how many rows it refused: a row whose new weights or state would not all be
    finite keeps its weights and state (the check runs per row inside the kernel).

    ``weights`` is float32 (the arena itself, or a widened copy of rows stored as
    ``storage``, whose finite range bounds every new weight); ``weight_index`` and ``slots``
    must hold no duplicates; ``grads`` is float32 (k, dim).
    """
    wi = np.ascontiguousarray(weight_index, dtype=np.int64)
    si = np.ascontiguousarray(slots, dtype=np.int64)
    grads = _clipped(config, grads)
    bound = _bound(config, np.dtype(storage))
    lr, wd = _F32(config.lr), _F32(config.weight_decay)
    if config.kind is OptimizerKind.SGD:
        return int(_sgd(weights, wi, grads, lr, wd, bound))
    if config.kind is OptimizerKind.ADAGRAD:
        return int(_adagrad(weights, wi, state["accum"], si, grads, lr, _F32(config.eps), wd,
                            bound))
    if config.kind is OptimizerKind.ROWWISE_ADAGRAD:
        return int(_rowwise_adagrad(weights, wi, state["accum"], si, grads, lr,
                                    _F32(config.eps), wd, bound))
    if config.kind is OptimizerKind.ADAM:
        return int(_adam(weights, wi, state["m"], state["v"], state["step"], si, grads, lr,
                         _F32(config.beta1), _F32(config.beta2), _F32(config.eps), wd, bound))
    return int(_ftrl(weights, wi, state["z"], state["n"], si, grads, lr, _F32(config.ftrl_beta),
                     _F32(config.ftrl_l1), _F32(config.ftrl_l2), bound))


def apply_updates(config: OptimizerConfig, tables: np.ndarray, rows_at: int, accum_at: int,
                  slots: np.ndarray, grads: np.ndarray, starts: np.ndarray, counts: np.ndarray
                  ) -> np.ndarray | None:
    """:func:`apply_update` for several float32 tables of one optimizer config in one call
    (a call a table costs more than the update of a few ids): table ``t`` (row ``t`` of
    ``tables``, :func:`services.common.kernel_arrays.refs` with its rows at field
    ``rows_at``, its accumulator at ``accum_at``) updates its rows and state rows
    ``slots[starts[t]:][:counts[t]]`` (distinct) with the ``grads`` there (float32, its
    dim wide). Returns the rows each table refused; None, nothing done, for the kinds
    without such a call (all but the two Adagrads)."""
    if (kernel := _TABLES_KERNELS.get(config.kind)) is None or not tables.shape[0]:
        return None
    refused = np.zeros(tables.shape[0], dtype=np.int64)
    kernel(tables, rows_at, accum_at, np.ascontiguousarray(slots, dtype=np.int64),
           _clipped(config, grads), np.ascontiguousarray(starts, dtype=np.int64),
           np.ascontiguousarray(counts, dtype=np.int64),
           _F32(config.lr), _F32(config.eps), _F32(config.weight_decay),
           _bound(config, np.dtype(np.float32)), refused)
    return refused
