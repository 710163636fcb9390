"""Serving: model versions exported from training, and a prediction server over them.

Layout (the service file set of STYLE.md):

- ``__main__``: the ``persimmon serve`` and ``persimmon export`` commands
- ``config``: :class:`ServeConfig`, :class:`ExportConfig`
- ``server`` (gRPC ``persimmon.Serve/Predict``), ``admin`` (REST: predict, versions,
  metrics), ``service`` (the process)
- ``export``: the on-disk version format (atomic, checksummed, full or incremental, pruned);
  ``sources``: versions from a live trainer or a job checkpoint
- ``spec``: the feature spec (raw records → ids and dense inputs, as the loader does)
- ``rows``: memory-mapped rows of a table, initial rows for ids never trained
- ``predictor``: one loaded, immutable version; ``versions``: hot swap and rollback;
  ``batching``: dynamic micro-batching
"""

from __future__ import annotations

from services.loader import Features, FeatureSpec, spec_from_source
from services.serve.export import list_versions, prune, read_manifest, write_version
from services.serve.predictor import Predictor
from services.serve.rows import InitialRows, TableRows
from services.serve.sources import export_job_checkpoint, export_trainer

__all__ = ["FeatureSpec", "Features", "InitialRows", "Predictor", "TableRows",
           "export_job_checkpoint", "export_trainer", "list_versions", "prune",
           "read_manifest", "spec_from_source", "write_version"]
