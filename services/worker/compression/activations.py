"""DCT-MP: per-sample hard thresholding of the pooled embedding activations (Gupta et al. 2020).

Between the embedding part of a model and its dense part, each sample's activations (the
pooled embeddings of every feature, concatenated: ``(B, D)``) keep only their
``ceil(keep · D)`` largest magnitudes; the rest are zero. The backward pass sends gradients
only at the kept positions (the mask is known to both sides, so only values travel back).
Kept values and their gradients are rounded to fp16, as they would be on the wire.

Byte accounting (:class:`~.collectives.CommStats`): raw is fp32 both ways (``8·B·D``); wire
is, per kept entry, an int32 index and an fp16 value forward plus an fp16 value backward
(``8`` bytes). So the ratio is ``D / k ≈ 1 / keep``.
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


def threshold_activations(x: Tensor, keep: float) -> Tensor:
    """``x`` (``(B, D)``) with all but each row's ``ceil(keep·D)`` largest magnitudes zeroed;
    its gradient flows only through the kept entries. ``keep = 1`` returns ``x`` itself."""
    if x.dim() != 2:
        raise InvalidArgument(f"activations must be (samples, width), got {tuple(x.shape)}")
    width = x.shape[1]
    k = kept_per_sample(keep, width)
    if k >= width:
        return x
    idx = torch.topk(x.detach().abs(), k, dim=1, sorted=False).indices
    mask = torch.zeros_like(x, dtype=torch.bool).scatter_(1, idx, True)
    return _Threshold.apply(x, mask)


class ActivationSparsifier:
    """Thresholds a batch's pooled features per sample, across features; counts bytes."""

    def __init__(self, keep: float) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int | float) or not 0 < keep <= 1:
            raise ConfigError(f"activation keep must be a fraction in (0, 1], got {keep!r}")
        self.keep = float(keep)
        self.stats = CommStats()

    def __call__(self, pooled: dict[str, Tensor]) -> dict[str, Tensor]:
        """The same features, each ``(B, dim)``, thresholded on their concatenation."""
        names = list(pooled)
        if not names:
            return pooled
        widths = [pooled[n].shape[1] for n in names]
        x = torch.cat([pooled[n] for n in names], dim=1)
        out = threshold_activations(x, self.keep)
        batch, width = x.shape
        k = kept_per_sample(self.keep, width)
        self.stats.add(8 * batch * width, 8 * batch * k if k < width else 8 * batch * width)
        self.stats.steps += 1
        return dict(zip(names, torch.split(out, widths, dim=1), strict=True))
