"""DCT-MP: hard thresholding of the pooled embedding activations (Gupta et al. 2020).

Between the embedding part of a model and its dense part, a batch's activations (the pooled
embeddings of every feature, concatenated: ``(B, D)``) keep only their entries with
``|x| >= tau``; the rest are zero. ``tau`` is the batch's ``(1 - keep)`` quantile of ``|x|``,
and, as in the paper, it is reused for ``refresh_every`` steps (the quantile is the expensive
part), refreshed sooner only when the kept share drifts outside ``[keep / 2, 2 keep]``. The
backward pass sends gradients only at the kept positions (the mask is known to both sides, so
only values travel back). Kept values and their gradients are rounded to fp16, as they would
be on the wire.

Training only: evaluation, and serving, use the unthresholded forward (the trainer applies
the sparsifier in its training step, never in ``evaluate``).

Byte accounting (:class:`~.collectives.CommStats`): raw is fp32 both ways (``8·B·D``); wire
is, per kept entry, an int32 index and an fp16 value forward plus an fp16 value backward
(``8`` bytes). These are the bytes such a split *would* send: in a trainer the activations
stay in its process (the DES path's shards threshold what they send: bench compression).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from services.common.errors import ConfigError, InvalidArgument
from services.worker.compression.collectives import CommStats

__all__ = ["ActivationSparsifier", "kept_per_sample", "threshold_activations"]


def kept_per_sample(keep: float, width: int) -> int:
    """k = ceil(keep · width), at least 1 for a non-empty row."""
    return min(width, max(1, math.ceil(keep * width))) if width else 0


class _Threshold(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, mask: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(mask)
        return torch.where(mask, x.to(torch.float16).to(x.dtype), torch.zeros_like(x))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        (mask,) = ctx.saved_tensors
        return torch.where(mask, grad.to(torch.float16).to(grad.dtype),
                           torch.zeros_like(grad)), None


REFRESH_EVERY = 32  # steps a threshold is reused (reconstructed: the paper gives no MP figure)


def activation_threshold(x: Tensor, keep: float) -> float:
    """The ``(1 - keep)`` quantile of ``|x|``: about ``keep`` of the entries are at least it."""
    flat = x.detach().abs().flatten()
    k = kept_per_sample(keep, flat.numel())
    if k >= flat.numel():
        return 0.0
    return float(torch.kthvalue(flat, flat.numel() - k + 1).values)


def threshold_activations(x: Tensor, tau: float) -> Tensor:
    """``x`` (``(B, D)``) with every entry below ``tau`` in magnitude zeroed (the rest
    rounded to fp16); its gradient flows only through the kept entries. ``tau <= 0``
    returns ``x`` itself."""
    if x.dim() != 2:
        raise InvalidArgument(f"activations must be (samples, width), got {tuple(x.shape)}")
    if tau <= 0:
        return x
    return _Threshold.apply(x, x.detach().abs() >= tau)


class ActivationSparsifier:
    """Thresholds a batch's pooled features across features, ``tau`` reused for
    ``refresh_every`` steps; counts bytes. ``refreshes``: how often ``tau`` was computed."""

    def __init__(self, keep: float, refresh_every: int = REFRESH_EVERY) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int | float) or not 0 < keep <= 1:
            raise ConfigError(f"activation keep must be a fraction in (0, 1], got {keep!r}")
        if isinstance(refresh_every, bool) or not isinstance(refresh_every, int) \
                or refresh_every < 1:
            raise ConfigError(f"activation refresh_every must be an int >= 1, "
                              f"got {refresh_every!r}")
        self.keep, self.refresh_every = float(keep), refresh_every
        self.stats = CommStats()
        self.tau: float | None = None
        self.refreshes = 0
        self._age = 0  # steps since tau was computed

    def _refresh(self, x: Tensor) -> float:
        self.tau, self._age = activation_threshold(x, self.keep), 0
        self.refreshes += 1
        return self.tau

    def __call__(self, pooled: dict[str, Tensor]) -> dict[str, Tensor]:
        """The same features, each ``(B, dim)``, thresholded on their concatenation."""
        names = list(pooled)
        if not names:
            return pooled
        widths = [pooled[n].shape[1] for n in names]
        x = torch.cat([pooled[n] for n in names], dim=1)
        if x.dim() != 2:
            raise InvalidArgument(f"activations must be (samples, width), got {tuple(x.shape)}")
        tau = self.tau if self.tau is not None and self._age < self.refresh_every \
            else self._refresh(x)
        kept = int((x.detach().abs() >= tau).sum()) if tau > 0 else x.numel()
        if tau > 0 and not self.keep / 2 <= kept / max(x.numel(), 1) <= 2 * self.keep:
            tau = self._refresh(x)  # the activations drifted: a fresh quantile
            kept = int((x.detach().abs() >= tau).sum()) if tau > 0 else x.numel()
        self._age += 1
        out = threshold_activations(x, tau)
        self.stats.add(8 * x.numel(), 8 * kept)
        self.stats.steps += 1
        return dict(zip(names, torch.split(out, widths, dim=1), strict=True))
