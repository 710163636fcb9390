"""Model versions built without training (helpers of tests/unit/serve): a small model with
random weights and rows."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.loader import FeatureSpec
from services.ps.tables import TableConfig, initial_rows
from services.serve.export import write_version
from services.serve.rows import TableRows
from services.worker.models import ModelConfig

SPEC = FeatureSpec(layout="json", dense=["I1", "I2"], sparse=["C1", "C2", "C3"],
                   multi_hot={"C3": "|"}, buckets={"C2": 50})
MODEL = ModelConfig(name="dlrm", bottom_mlp=[8, 4], top_mlp=[8])
DIMS = {"C1": 4, "C2": 4, "C3": 6}
TABLES = {"C1": {"name": "C1", "dim": 4, "seed": 1},
          "C2": {"name": "C2", "dim": 4, "seed": 2, "initializer": "normal"},
          "C3": {"name": "C3", "dim": 6, "seed": 3}}


def ps_initial_rows(config: Mapping[str, Any], ids: np.ndarray) -> np.ndarray:
    """The PS's own initial rows (what the CLI injects)."""
    return initial_rows(TableConfig(**config), ids)


def random_tables(rng: np.random.Generator, rows: int = 20) -> dict[str, TableRows]:
    out = {}
    for name, config in TABLES.items():
        ids = rng.choice(2**40, size=rows, replace=False).astype(np.uint64)
        out[name] = TableRows(name=name, ids=ids, config=config,
                              rows=rng.normal(size=(rows, config["dim"])).astype(np.float32))
    return out


MakeVersion = Callable[..., dict[str, Any]]


def version_factory(tmp_path: Path) -> MakeVersion:
    """``make_version(step=..., seed=..., row_dtype=...)`` writes a version into
    ``tmp_path / "models"`` and returns its manifest (``tables`` and ``state`` attached)."""
    def make(*, step: int = 1, seed: int = 0, row_dtype: str = "float32",
             keep: int | None = None, model_dir: Path | None = None) -> dict[str, Any]:
        torch.manual_seed(seed)
        rng = np.random.default_rng(seed)
        module = MODEL.build(sparse_dims=DIMS, num_dense=2)
        tables = random_tables(rng)
        manifest = write_version(model_dir or tmp_path / "models", step=step, model=MODEL,
                                 state=module.state_dict(), features={f: f for f in DIMS},
                                 num_dense=2, tables=tables, spec=SPEC, row_dtype=row_dtype,
                                 keep=keep)
        return {**manifest, "_tables": tables, "_module": module}
    return make
