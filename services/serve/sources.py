"""Where a model version comes from: a live trainer with its PS rows, or a job checkpoint.

Serving does not import the PS (the layering of docs/design.md), so the PS side comes in as
plain data or as an injected reader:

- :func:`export_trainer`: the trainer's dense model and step now, with the PS tables' rows as
  snapshots (e.g. from the PS checkpoint reader, or the in-process shards' tables).
- :func:`export_job_checkpoint`: a complete job checkpoint on disk: its ``dense`` part
  (:func:`services.worker.job_checkpoints.load_dense_part`) and every shard's part, read by
  ``read_shards(root, checkpoint_id)`` (the PS checkpoint reader, injected by the caller:
  it returns each table's snapshots in the order to apply them, over all shards).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from services.common.checkpoints import read_job_manifest, read_part
from services.common.errors import FailedPrecondition, InvalidArgument
from services.loader import FeatureSpec
from services.serve.export import SnapshotLike, tables_from_snapshots, write_version
from services.worker.job_checkpoints import load_dense_part
from services.worker.models import ModelConfig

__all__ = ["ReadShards", "export_job_checkpoint", "export_trainer"]

ReadShards = Callable[[Path, str], Mapping[str, Sequence[SnapshotLike]]]


def export_trainer(model_dir: Path | str, trainer: Any, snapshots: Mapping[str,
                   Sequence[SnapshotLike]], *, model: ModelConfig, spec: FeatureSpec,
                   **options: Any) -> dict[str, Any]:
    """Export ``trainer`` (its module, step, tables and pooling) with the PS rows in
    ``snapshots``; call it between steps. ``options`` go to :func:`write_version`."""
    module = trainer.module
    if module is None or trainer.tables is None:
        raise FailedPrecondition("the trainer has no model before its first batch")
    options.setdefault("pooling", trainer.config.pooling)
    options.setdefault("source", {"kind": "trainer"})
    return write_version(model_dir, step=int(trainer.step), model=model,
                         state=module.state_dict(), features=dict(trainer.tables),
                         num_dense=int(module.num_dense),
                         tables=tables_from_snapshots(snapshots), spec=spec, **options)


def export_job_checkpoint(root: Path | str, checkpoint_id: str, model_dir: Path | str, *,
                          read_shards: ReadShards, model: ModelConfig, spec: FeatureSpec,
                          features: Mapping[str, str] | None = None,
                          table_prefix: str = "", **options: Any) -> dict[str, Any]:
    """Export a complete job checkpoint. ``features`` maps each sparse feature to its table
    (default: ``table_prefix + feature`` for every sparse feature of ``spec``)."""
    root = Path(root)
    manifest = read_job_manifest(root, checkpoint_id)
    dense = load_dense_part(read_part(root, manifest, "dense"))
    if not isinstance(dense, dict) or "model" not in dense:
        raise FailedPrecondition(f"job checkpoint {checkpoint_id!r}: its dense part holds no "
                                 "model state")
    chains = read_shards(root, checkpoint_id)
    features = dict(features) if features is not None else {
        f: table_prefix + f for f in spec.sparse}
    missing = sorted(set(features.values()) - set(chains))
    if missing:
        raise InvalidArgument(f"job checkpoint {checkpoint_id!r} has no tables {missing}; it "
                              f"has {sorted(chains)}")
    options.setdefault("source", {"kind": "job_checkpoint", "checkpoint_id": checkpoint_id})
    return write_version(model_dir, step=int(manifest["step"]), model=model,
                         state=dense["model"], features=features, num_dense=len(spec.dense),
                         tables=tables_from_snapshots({t: chains[t] for t in
                                                       set(features.values())}),
                         spec=spec, **options)
