"""Serving: model versions exported from training, and a prediction server over them.

Layout (the service file set of STYLE.md):

- ``__main__``: the ``persimmon serve`` and ``persimmon export`` commands
- ``config``: :class:`ServeConfig`, :class:`ExportConfig`
- ``server`` (gRPC ``persimmon.Serve/Predict``), ``admin`` (REST: predict, versions,
  metrics), ``service`` (the process)
- ``export``: the on-disk version format (atomic, checksummed, full or incremental, pruned);
  ``sources``: versions from a live trainer or a job checkpoint
- ``weights``: the dense weights file (safetensors); ``rows``: memory-mapped rows of a
  table, initial rows for ids never trained
- ``forward``: the models' forward pass in NumPy; ``bags``: ids pooled per record
- ``predictor``: one loaded, immutable version; ``versions``: hot swap and rollback;
  ``batching``: dynamic micro-batching

Serving a version needs no torch (the core install); writing one (``write_version``, the
``sources``) takes the trainer's torch state and needs the ``[train]`` extra. Names load on
first use, so importing the package pulls in neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.common.lazy import lazy_exports
from services.loader import Features, FeatureSpec, spec_from_source

if TYPE_CHECKING:
    from services.serve.export import list_versions, prune, read_manifest, write_version
    from services.serve.predictor import Predictor
    from services.serve.rows import InitialRows, TableRows
    from services.serve.sources import export_job_checkpoint, export_trainer

__all__ = ["FeatureSpec", "Features", "InitialRows", "Predictor", "TableRows",
           "export_job_checkpoint", "export_trainer", "list_versions", "prune",
           "read_manifest", "spec_from_source", "write_version"]

_HOME = {
    "InitialRows": "rows", "Predictor": "predictor", "TableRows": "rows",
    "export_job_checkpoint": "sources", "export_trainer": "sources",
    "list_versions": "export", "prune": "export", "read_manifest": "export",
    "write_version": "export",
}

__getattr__, __dir__ = lazy_exports(__name__, globals(), _HOME)
