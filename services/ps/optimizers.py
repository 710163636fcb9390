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
``weight_bound`` clips every updated weight of every kind to ``[-bound, bound]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numba import njit

from services.ps.hashtable import PREFETCH_DISTANCE as AHEAD
from services.ps.hashtable import prefetch, prefetch_row
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


@njit(cache=True, nogil=True)
def _clip(w, bound):  # pragma: no cover - numba
    return min(max(w, -bound), bound)


@njit(cache=True, nogil=True)
def _sgd(W, wi, G, lr, wd, bound):  # pragma: no cover - numba
    n = G.shape[0]
    for k in range(n):
        if k + AHEAD < n:
            prefetch_row(W, wi[k + AHEAD])
        r = wi[k]
        for c in range(G.shape[1]):
            W[r, c] = _clip(W[r, c] - lr * (G[k, c] + wd * W[r, c]), bound)


@njit(cache=True, nogil=True)
def _adagrad(W, wi, A, si, G, lr, eps, wd, bound):  # pragma: no cover - numba
    n = G.shape[0]
    for k in range(n):
        if k + AHEAD < n:
            prefetch_row(W, wi[k + AHEAD])
            prefetch_row(A, si[k + AHEAD])
        r = wi[k]
        s = si[k]
        for c in range(G.shape[1]):
            g = G[k, c] + wd * W[r, c]
            a = A[s, c] + g * g
            A[s, c] = a
            W[r, c] = _clip(W[r, c] - lr * g / (np.sqrt(a) + eps), bound)


@njit(cache=True, nogil=True)
def _rowwise_adagrad(W, wi, A, si, G, lr, eps, wd, bound):  # pragma: no cover - numba
    n = G.shape[0]
    dim = G.shape[1]
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
        A[s] = a
        scale = lr / (np.sqrt(a) + eps)
        for c in range(dim):
            W[r, c] = _clip(W[r, c] - scale * (G[k, c] + wd * W[r, c]), bound)


@njit(cache=True, nogil=True)
def _adam(W, wi, M, V, T, si, G, lr, b1, b2, eps, wd, bound):  # pragma: no cover - numba
    one = np.float32(1.0)
    b1d = np.float64(b1)
    b2d = np.float64(b2)
    n = G.shape[0]
    for k in range(n):
        if k + AHEAD < n:
            prefetch_row(W, wi[k + AHEAD])
            prefetch_row(M, si[k + AHEAD])
            prefetch_row(V, si[k + AHEAD])
            prefetch(T, si[k + AHEAD])
        r = wi[k]
        s = si[k]
        t = T[s] + 1
        T[s] = t
        bc1 = np.float32(1.0 - b1d ** t)
        bc2 = np.float32(1.0 - b2d ** t)
        for c in range(G.shape[1]):
            g = G[k, c] + wd * W[r, c]
            m = b1 * M[s, c] + (one - b1) * g
            v = b2 * V[s, c] + (one - b2) * g * g
            M[s, c] = m
            V[s, c] = v
            W[r, c] = _clip(W[r, c] - lr * (m / bc1) / (np.sqrt(v / bc2) + eps), bound)


@njit(cache=True, nogil=True)
def _ftrl(W, wi, Z, N, si, G, alpha, beta, l1, l2, bound):  # pragma: no cover - numba
    zero = np.float32(0.0)
    n = G.shape[0]
    for k in range(n):
        if k + AHEAD < n:
            prefetch_row(W, wi[k + AHEAD])
            prefetch_row(Z, si[k + AHEAD])
            prefetch_row(N, si[k + AHEAD])
        r = wi[k]
        s = si[k]
        for c in range(G.shape[1]):
            g = G[k, c]
            n_old = N[s, c]
            n_new = n_old + g * g
            sigma = (np.sqrt(n_new) - np.sqrt(n_old)) / alpha
            z = Z[s, c] + g - sigma * W[r, c]
            Z[s, c] = z
            N[s, c] = n_new
            if abs(z) <= l1:
                w = zero
            else:
                w = -(z - np.sign(z) * l1) / ((beta + np.sqrt(n_new)) / alpha + l2)
            W[r, c] = _clip(w, bound)


@njit(cache=True, nogil=True)
def _adagrad_tables(Ws, As, slots, G, starts, counts, lr, eps, wd, bound):  # pragma: no cover
    """:func:`_adagrad` for each table ``t``: its rows ``slots[starts[t]:][:counts[t]]``."""
    for t in range(len(Ws)):
        lo, hi = starts[t], starts[t] + counts[t]
        _adagrad(Ws[t], slots[lo:hi], As[t], slots[lo:hi], G[lo:hi], lr, eps, wd, bound)


@njit(cache=True, nogil=True)
def _rowwise_adagrad_tables(Ws, As, slots, G, starts, counts, lr, eps, wd,
                            bound):  # pragma: no cover - numba
    """:func:`_rowwise_adagrad` for each table ``t``: its rows ``slots[starts[t]:][:counts[t]]``."""
    for t in range(len(Ws)):
        lo, hi = starts[t], starts[t] + counts[t]
        _rowwise_adagrad(Ws[t], slots[lo:hi], As[t], slots[lo:hi], G[lo:hi], lr, eps, wd,
                         bound)


_TABLES_KERNELS = {OptimizerKind.ADAGRAD: _adagrad_tables,  # the kinds apply_updates serves
                   OptimizerKind.ROWWISE_ADAGRAD: _rowwise_adagrad_tables}


def _bound(config: OptimizerConfig) -> np.float32:
    """The weight bound as the kernels take it (inf: none)."""
    return _F32(np.inf if config.weight_bound is None else config.weight_bound)


def apply_update(config: OptimizerConfig, weights: np.ndarray, weight_index: np.ndarray,
                 state: dict[str, np.ndarray], slots: np.ndarray, grads: np.ndarray) -> None:
    """Update ``weights[weight_index[k]]`` with ``grads[k]`` in place, state rows ``slots[k]``.

    ``weights`` is float32 (the arena itself, or a widened copy of float16 rows);
    ``weight_index`` and ``slots`` must hold no duplicates; ``grads`` is float32 (k, dim).
    """
    wi = np.ascontiguousarray(weight_index, dtype=np.int64)
    si = np.ascontiguousarray(slots, dtype=np.int64)
    grads = np.ascontiguousarray(grads, dtype=np.float32)
    bound = _bound(config)
    lr, wd = _F32(config.lr), _F32(config.weight_decay)
    if config.kind is OptimizerKind.SGD:
        _sgd(weights, wi, grads, lr, wd, bound)
    elif config.kind is OptimizerKind.ADAGRAD:
        _adagrad(weights, wi, state["accum"], si, grads, lr, _F32(config.eps), wd, bound)
    elif config.kind is OptimizerKind.ROWWISE_ADAGRAD:
        _rowwise_adagrad(weights, wi, state["accum"], si, grads, lr, _F32(config.eps), wd,
                         bound)
    elif config.kind is OptimizerKind.ADAM:
        _adam(weights, wi, state["m"], state["v"], state["step"], si, grads, lr,
              _F32(config.beta1), _F32(config.beta2), _F32(config.eps), wd, bound)
    else:
        _ftrl(weights, wi, state["z"], state["n"], si, grads, lr, _F32(config.ftrl_beta),
              _F32(config.ftrl_l1), _F32(config.ftrl_l2), bound)


def apply_updates(config: OptimizerConfig, weights: Sequence[np.ndarray],
                  states: Sequence[dict[str, np.ndarray]], slots: np.ndarray, grads: np.ndarray,
                  starts: np.ndarray, counts: np.ndarray) -> bool:
    """:func:`apply_update` for several float32 tables of one optimizer config in one call
    (a call a table costs more than the update of a few ids): table ``t`` updates its rows
    and state rows ``slots[starts[t]:][:counts[t]]`` (distinct) with the ``grads`` there.
    False, nothing done, for the kinds without such a call (all but the two Adagrads)."""
    if (kernel := _TABLES_KERNELS.get(config.kind)) is None or not weights:
        return False
    kernel(tuple(weights), tuple(state["accum"] for state in states),
           np.ascontiguousarray(slots, dtype=np.int64),
           np.ascontiguousarray(grads, dtype=np.float32),
           np.ascontiguousarray(starts, dtype=np.int64),
           np.ascontiguousarray(counts, dtype=np.int64),
           _F32(config.lr), _F32(config.eps), _F32(config.weight_decay), _bound(config))
    return True
