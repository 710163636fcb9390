"""1-bit Adam and 1-bit LAMB on several tensors of very different scales, step by step against
the papers' updates written out here (DeepSpeed's OnebitAdam / OnebitLamb, no bias correction).

With one tensor the per-tensor momentum scale ``mean_q RMS(m_q) / RMS(m_p)`` is always 1 and
any trust ratio can be swapped for its inverse unseen; with two tensors whose gradients and
weights are orders of magnitude apart, an inverted or missing ratio moves the weights
elsewhere. One rank: the two-phase 1-bit all-reduce of ``x`` is then ``RMS(x)·sign(x)`` (the
server error stays 0) with the worker error ``x − RMS(x)·sign(x)`` carried to the next step.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from services.worker.compression import OnebitAdam, OnebitLamb

B1, B2, EPS, LR, FREEZE = 0.9, 0.999, 1e-8, 0.01, 2
SIZES = (8, 16)                      # 24 elements: a whole number of bytes, no padding


def _setup() -> tuple[list[nn.Parameter], list[list[Tensor]]]:
    """Two tensors (weights 3 and 0.05 in scale) and 4 steps of gradients (1 and 1e-3)."""
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(3.0 * torch.randn(SIZES[0], generator=gen)),
              nn.Parameter(0.05 * torch.randn(SIZES[1], generator=gen))]
    grads = [[scale * torch.randn(n, generator=gen)
              for n, scale in zip(SIZES, (1.0, 1e-3), strict=True)] for _ in range(4)]
    return params, grads


def _rms(x: Tensor) -> float:
    return float(x.norm()) / x.numel() ** 0.5


def _one_bit(x: Tensor) -> Tensor:
    """One rank's 1-bit all-reduce: RMS(x)·sign(x), sign(0) = +1."""
    return _rms(x) * torch.where(x < 0, -1.0, 1.0)


def _run(opt: torch.optim.Optimizer, params: list[nn.Parameter],
         grads: list[list[Tensor]]) -> list[list[Tensor]]:
    out = []
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        opt.step()
        out.append([p.detach().clone() for p in params])
    return out


class _Compressed:
    """The compression stage's momentum exchange written out: scales fixed from the momenta
    at the end of the warm-up, one flat buffer, worker error feedback."""

    def __init__(self, m: list[Tensor]) -> None:
        rms = [_rms(t) for t in m]
        united = sum(rms) / len(rms)
        self.k = [united / r for r in rms]
        self.error = torch.zeros(sum(SIZES))

    def mean(self, m: list[Tensor]) -> list[Tensor]:
        x = torch.cat([k * t for k, t in zip(self.k, m, strict=True)]) + self.error
        sent = _one_bit(x)
        self.error = x - sent
        return [part / k for part, k in zip(sent.split(SIZES), self.k, strict=True)]


def test_onebit_adam_scales_each_tensor_as_written_out() -> None:
    params, grads = _setup()
    opt = OnebitAdam(params, lr=LR, betas=(B1, B2), eps=EPS, freeze_step=FREEZE,
                     bias_correction=False, variance_floor=0.0)
    got = _run(opt, params, grads)

    w, _ = _setup()
    w = [p.detach().clone() for p in w]
    m = [torch.zeros_like(t) for t in w]
    v = [torch.zeros_like(t) for t in w]
    exchange: _Compressed | None = None
    for t, step_grads in enumerate(grads, start=1):
        if t <= FREEZE:                                    # Adam on the (one-rank) mean grad
            m = [B1 * mi + (1 - B1) * g for mi, g in zip(m, step_grads, strict=True)]
            v = [B2 * vi + (1 - B2) * g * g for vi, g in zip(v, step_grads, strict=True)]
        else:                                              # v frozen, momenta compressed
            exchange = exchange or _Compressed(m)
            m = exchange.mean([B1 * mi + (1 - B1) * g
                               for mi, g in zip(m, step_grads, strict=True)])
        w = [wi - LR * mi / (vi.sqrt() + EPS) for wi, mi, vi in zip(w, m, v, strict=True)]
        for ours, theirs in zip(got[t - 1], w, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert exchange is not None and max(exchange.k) / min(exchange.k) > 100   # scales apart


def _clip(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def test_onebit_lamb_trust_ratios_and_scales_as_written_out() -> None:
    params, grads = _setup()
    opt = OnebitLamb(params, lr=LR, betas=(B1, B2), eps=EPS, freeze_step=FREEZE,
                     max_coeff=10.0, min_coeff=0.01, variance_floor=0.0)
    got, coeffs = [], []
    for step_grads in grads:
        got.extend(_run(opt, params, [step_grads]))
        coeffs.append(list(opt.last_coeffs))

    w, _ = _setup()
    w = [p.detach().clone() for p in w]
    m = [torch.zeros_like(t) for t in w]
    v = [torch.zeros_like(t) for t in w]
    v_fresh: list[Tensor] = []
    c_freeze, last_f = [0.0, 0.0], [1.0, 1.0]
    exchange: _Compressed | None = None
    for t, step_grads in enumerate(grads, start=1):
        want = []
        if t <= FREEZE:                                    # LAMB warm-up
            m = [B1 * mi + (1 - B1) * g for mi, g in zip(m, step_grads, strict=True)]
            v = [B2 * vi + (1 - B2) * g * g for vi, g in zip(v, step_grads, strict=True)]
            if t == FREEZE:
                v_fresh = [vi.clone() for vi in v]
            for q in range(2):
                u = m[q] / (v[q].sqrt() + EPS)
                c = _clip(float(w[q].norm()) / float(u.norm()), 0.01, 10.0)   # ||p|| / ||u||
                c_freeze[q] = 0.9 * c_freeze[q] + 0.1 * c
                want.append(c)
                w[q] = w[q] - LR * c * u
        else:                                              # frozen v, 1-bit momenta
            exchange = exchange or _Compressed(m)
            m_prev = m
            m = exchange.mean([B1 * mi + (1 - B1) * g
                               for mi, g in zip(m, step_grads, strict=True)])
            for q in range(2):
                g_rec = (m[q] - B1 * m_prev[q]) / (1 - B1)
                v_fresh[q] = B2 * v_fresh[q] + (1 - B2) * g_rec * g_rec
                denom = v[q].sqrt() + EPS
                f = float((denom / (v_fresh[q].sqrt() + EPS)).max())
                f = _clip(_clip(f, 0.5, 4.0), 0.9 * last_f[q], 1.1 * last_f[q])
                last_f[q] = f
                want.append(c_freeze[q] * f)
                w[q] = w[q] - LR * c_freeze[q] * f * (m[q] / denom)
        torch.testing.assert_close(torch.tensor(coeffs[t - 1]), torch.tensor(want), rtol=1e-5,
                                   atol=0)
        for ours, theirs in zip(got[t - 1], w, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    warm = coeffs[0]
    assert warm[0] / warm[1] > 5 or warm[1] / warm[0] > 5        # the two ratios are apart
