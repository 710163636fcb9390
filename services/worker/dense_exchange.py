"""The dense exchange: how a worker's dense replica crosses to the other ranks through codecs,
and what that costs.

A :class:`DenseExchange` is made from a :class:`~services.worker.config.TrainerConfig`. It
builds the dense sync that carries ``dense_codec`` (the DDP comm hook with ``sync allreduce``,
a :class:`~services.worker.compression.CodecAverager` with a parameter-averaging strategy),
or, with a 1-bit optimizer (which all-reduces itself), starts the replicas equal and counts
that optimizer's bytes. Every step it gives the loss averaged over the ranks to the adaquant
codecs (the dense one here; the rows clients' grads codecs when the event loop hands it those)
and records the level each chose; it thresholds the pooled activations (DCT-MP); and it
reports its bytes per stream and codec. It knows nothing of the Trainer that asks.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from services.common.codecs.qsgd import adapts_to_loss
from services.common.errors import ConfigError
from services.worker.compression import (
    ActivationSparsifier,
    CodecAverager,
    CommStats,
    make_comm_hook,
)
from services.worker.config import TrainerConfig
from services.worker.dense_optimizers import ONEBIT_OPTIMIZERS
from services.worker.distributed import mean_over_ranks
from services.worker.summary import RECENT_LOSSES
from services.worker.sync import SyncStrategy

__all__ = ["DenseExchange"]


class DenseExchange:
    """The codecs between the dense replicas of ``config``'s ranks (``sync_given``: the
    caller brings its own sync strategy, refused with ``dense_codec`` or a 1-bit optimizer).

    ``levels`` holds the s of the adaquant codecs at the latest steps (at most
    ``RECENT_LOSSES``): ``"dense"`` (the hook or the averager) and ``"grads"`` (the PS's).
    """

    def __init__(self, config: TrainerConfig, *, sync_given: bool = False) -> None:
        self.onebit = config.dense_optimizer in ONEBIT_OPTIMIZERS
        if sync_given and (self.onebit or config.dense_codec != "none"):
            raise ConfigError("dense_codec and the 1-bit optimizers set up the dense all-reduce "
                              "themselves; do not pass a sync strategy with them")
        self._config = config
        self._codec = config.dense_optimizer if self.onebit else config.dense_codec
        self._dense_adapts = adapts_to_loss(config.dense_codec)
        self.feeds_grads_codec = adapts_to_loss(config.grads_codec)  # the event loop's part
        self._shares_loss = self._dense_adapts or self.feeds_grads_codec
        self.levels: dict[str, collections.deque[int]] = {
            stream: collections.deque(maxlen=RECENT_LOSSES) for stream in ("dense", "grads")}
        self._activations = (ActivationSparsifier(config.activation_keep)  # DES: the wire's
                             if config.activation_keep < 1
                             and config.embedding_path != "des" else None)
        self._stats: CommStats | None = None  # bytes of the dense exchange set up here
        self._report: Callable[[float], Any] | None = None  # the dense adaquant codec

    def sync_for(self, module: nn.Module, given: SyncStrategy | None, *,
                 several: bool) -> SyncStrategy | None:
        """The dense sync of ``module``: ``given`` if any; with more than one rank,
        ``config.sync`` carrying ``dense_codec``; none with a 1-bit optimizer, whose replicas
        start equal here (rank 0's parameters broadcast: a collective)."""
        if given is not None or not several:
            return given
        if self.onebit:
            for p in module.parameters():
                dist.broadcast(p.data, 0)
            return None
        cfg = self._config
        if cfg.sync == "allreduce":
            state, hook = make_comm_hook(cfg.dense_codec)
            self._count(state)
            return cfg.sync_config().build(comm_hook=(state, hook))
        averager = CodecAverager(cfg.dense_codec) if cfg.dense_codec != "none" else None
        if averager is not None:
            self._count(averager)
        return cfg.sync_config().build(averager=averager)

    def count_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Count the bytes of a 1-bit ``optimizer``'s all-reduce (other optimizers send none)."""
        if self.onebit:
            self._stats = getattr(optimizer, "stats", None)

    def _count(self, carrier: Any) -> None:
        """Count the bytes of ``carrier`` (a comm hook's state or an averager); it gets the
        loss when its codec adapts to it (only adaquant's carriers have ``report_loss``)."""
        self._stats = carrier.stats
        self._report = carrier.report_loss if self._dense_adapts else None

    def after_loss(self, loss: torch.Tensor) -> float:
        """The step's ``loss`` averaged over the ranks where an adaquant codec follows it
        (a collective: every rank calls it at each step), else NaN; the dense codec gets it
        before the backward pass and its level is recorded."""
        shared = mean_over_ranks(loss) if self._shares_loss else math.nan
        if self._report is not None:
            self.levels["dense"].append(self._report(shared))
        return shared

    async def report_grads_loss(self, loss: float, clients: Iterable[object],
                                recorded: object) -> None:
        """Feed ``loss`` (:meth:`after_loss`'s) to the adaquant grads codecs of ``clients``
        before the step's push (in hybrid mode a push not yet encoded when the next step
        reports may use its s); the level of ``recorded``'s is kept."""
        for client in clients if self.feeds_grads_codec else ():
            report = getattr(client, "report_loss", None)
            levels = await report(loss) if report is not None else None
            if levels is not None and client is recorded:
                self.levels["grads"].append(levels)

    def sparsify(self, pooled: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A training step's pooled activations with DCT-MP (kept positions only), or as
        given without ``activation_keep``."""
        return self._activations(pooled) if self._activations is not None else pooled

    def codec_rows(self) -> list[dict[str, Any]]:
        """Raw and wire bytes sent by the dense exchange and the DCT-MP activations, one
        row per stream and codec (none for a stream not set up)."""
        streams = (("dense_allreduce", self._codec, self._stats),
                   ("activations", "dct_mp",
                    self._activations.stats if self._activations is not None else None))
        return [{"stream": stream, "codec": codec, "direction": "sent",
                 "raw_bytes": stats.raw_bytes, "wire_bytes": stats.wire_bytes}
                for stream, codec, stats in streams if stats is not None]

    def dense_bytes(self) -> dict[str, Any]:
        """The dense exchange's byte counts (empty when none was set up)."""
        return self._stats.as_dict() if self._stats is not None else {}

    def activation_bytes(self) -> dict[str, Any]:
        """The DCT-MP activations' byte counts (empty without ``activation_keep``)."""
        return self._activations.stats.as_dict() if self._activations is not None else {}
