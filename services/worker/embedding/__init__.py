"""The embedding side of a worker: every object that reaches the embedding rows, one owner each.

Where a batch's ids are planned (:mod:`services.worker.pooling`), looked up, pushed and
acknowledged: the :class:`EmbeddingPipeline` (:mod:`.pipeline`) runs lookups ahead of compute
and pushes behind it under the staleness window (:mod:`.slots`: slots and riders), with the hot
groups routed once (:mod:`.routes`: the hot policy; :mod:`.heads`, :mod:`.hot_chain`,
:mod:`.replica_seeds`), what travels decided by the embedding path (:mod:`.exchange`), and the
rows reached through the :class:`RowsClient` port (:mod:`.rows`). :func:`connect`
(:mod:`.builder`) builds it all from a :class:`~services.worker.config.TrainerConfig`, with the
window sized where the staleness is ``auto`` (:mod:`.window`) and the waits across workers
(:mod:`.collectives`).

Names load on first use (the pipeline pulls in torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.common.lazy import lazy_exports

if TYPE_CHECKING:
    from services.worker.embedding.builder import EmbeddingLink, connect
    from services.worker.embedding.pipeline import EmbeddingPipeline, Prepared
    from services.worker.embedding.rows import RowsCapabilities, RowsClient

__all__ = ["EmbeddingLink", "EmbeddingPipeline", "Prepared", "RowsCapabilities", "RowsClient",
           "connect"]

_HOME = {
    "EmbeddingLink": "builder", "EmbeddingPipeline": "pipeline", "Prepared": "pipeline",
    "RowsCapabilities": "rows", "RowsClient": "rows", "connect": "builder",
}

__getattr__, __dir__ = lazy_exports(__name__, globals(), _HOME)
