"""Serving's NumPy forward equals the torch model training built, for every model family:
raw Criteo lines parsed by the loader's training parser, pooled and run through the torch
model, against the same lines served by a Predictor (featurized, pooled and run in NumPy)
over the exported version of that model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from serve_versions import ps_initial_rows

from services.common.errors import FailedPrecondition
from services.loader import FeatureSpec
from services.loader.hashing import DenseTransform
from services.loader.parsers import TextParser
from services.loader.schema import criteo_layout
from services.serve.bags import POOLING
from services.serve.export import write_version
from services.serve.forward import DENSE_NORM_EPS, FAMILIES, dense_forward
from services.serve.predictor import Predictor
from services.serve.rows import TableRows
from services.worker.models import MODELS, DenseNorm, ModelConfig
from services.worker.pooling import POOLING_MODES, plan_batch, pool_batch

TRANSFORM = DenseTransform(clip_max=1e4)
# C1..C12: the manifest's sorted keys put C10 before C2, the model takes them in this order
SPARSE = [f"C{i + 1}" for i in range(12)]
# C11 and C12 share a table; dims differ (projections to a common dim)
TABLE_OF = {f: ("shared" if f in ("C11", "C12") else f"t{f}") for f in SPARSE}

CASES: dict[str, tuple[dict[str, Any], str, int]] = {  # config, pooling, dense columns
    "dlrm": ({"bottom_mlp": [8, 4], "top_mlp": [8], "dense_norm": True}, "sum", 3),
    "dlrm-no-dense": ({"bottom_mlp": [8, 6], "top_mlp": [8]}, "mean", 0),
    "deepfm-id-weights": ({"deep_mlp": [8], "id_weights": True, "dense_norm": True},
                          "mean", 3),
    "deepfm-fm-dim": ({"deep_mlp": [], "fm_dim": 5}, "sum", 3),
    "dcnv2-stacked": ({"cross_layers": 2, "deep_mlp": [8, 4], "dense_norm": True}, "sum", 3),
    "dcnv2-parallel-low-rank": ({"cross_layers": 3, "cross_rank": 3, "deep_mlp": [],
                                 "structure": "parallel"}, "sum", 3),
    "wide_deep-id-weights": ({"deep_mlp": [8, 4], "id_weights": True, "dense_norm": True},
                             "sum", 3),
    "wide_deep": ({"deep_mlp": [8]}, "mean", 3),
    "lr": ({"dense_norm": True}, "sum", 3),
}


def lines(rng: np.random.Generator, n: int, num_dense: int, *, training: bool) -> list[str]:
    """Criteo lines, multi-hot and empty categorical values among them. In training I3 is 5
    but once 6 (its variance is small: DenseNorm's eps counts), then 5 or 6."""
    out = []
    for r in range(n):
        dense = [str(rng.integers(-3, 500)) if rng.random() > 0.2 else ""
                 for _ in range(num_dense)]
        if num_dense >= 3:
            dense[2] = ("6" if r == 0 else "5") if training else str(rng.integers(5, 7))
        sparse = ["|".join(f"v{rng.integers(0, 15)}" for _ in range(rng.integers(0, 4)))
                  for _ in SPARSE]
        out.append("\t".join(["0", *dense, *sparse]))
    return out


def table_rows(parsed: list[Any], dims: dict[str, int], rng: np.random.Generator
               ) -> dict[str, TableRows]:
    """A row for every id the parsed lines hold, per table."""
    out = {}
    for i, table in enumerate(dict.fromkeys(TABLE_OF.values())):
        ids = np.unique(np.concatenate([p.sparse[f].values for p in parsed
                                        for f in SPARSE if TABLE_OF[f] == table]))
        out[table] = TableRows(name=table, ids=ids, config={"name": table, "dim": dims[table],
                                                            "seed": i},
                               rows=rng.normal(0, 0.5, (ids.size, dims[table])).astype(
                                   np.float32))
    return out


def torch_logits(model: torch.nn.Module, parsed: Any, tables: dict[str, TableRows],
                 pooling: str) -> np.ndarray:
    """Training's forward of a parsed batch: the worker's dedup and pooling, the model."""
    by_dim: dict[int, list[str]] = {}
    for t in dict.fromkeys(TABLE_OF.values()):
        by_dim.setdefault(tables[t].rows.shape[1], []).append(t)
    plan = plan_batch({f: parsed.sparse[f] for f in SPARSE}, table_of=TABLE_OF, num_shards=1,
                      groups=list(by_dim.values()))
    rows = []
    for g in plan.groups:
        parts = []
        for t in g.layout.tables:
            table = tables[t].sorted()
            ids = g.layout.table_ids(t)
            parts.append(table.rows[np.searchsorted(table.ids, ids)])
        rows.append(np.concatenate(parts))
    with torch.inference_mode():
        pooled = pool_batch(plan, rows, mode=pooling).pooled
        return model(pooled, torch.from_numpy(parsed.dense)).numpy()


@pytest.mark.parametrize("case", sorted(CASES))
def test_numpy_forward_equals_the_torch_model(tmp_path: Path, case: str) -> None:
    arch, pooling, num_dense = CASES[case]
    config = ModelConfig(name=case.partition("-")[0], **arch)
    layout = criteo_layout(num_dense, len(SPARSE), multi_hot="|")
    spec = FeatureSpec.from_layout(layout, TRANSFORM, kind="criteo")
    parser = TextParser(layout, TRANSFORM)
    rng = np.random.default_rng(sum(map(ord, case)))
    train_lines = lines(rng, 64, num_dense, training=True)
    probe_lines = lines(rng, 48, num_dense, training=False)
    train, probe = (parser.parse(("\n".join(x) + "\n").encode())
                    for x in (train_lines, probe_lines))
    dims = {t: config.table_dim(4 if t in ("tC2", "tC5", "shared") else 6)
            for t in TABLE_OF.values()}
    tables = table_rows([train, probe], dims, rng)
    torch.manual_seed(0)
    model = config.build(sparse_dims={f: dims[TABLE_OF[f]] for f in SPARSE},
                         num_dense=num_dense)
    torch_logits(model, train, tables, pooling)  # DenseNorm's statistics, in train mode
    model.eval()
    if config.dense_norm and num_dense:
        assert float(model.state_dict()["dense_norm.count"]) == 64
    manifest = write_version(tmp_path, step=1, model=config, state=model.state_dict(),
                             features=TABLE_OF, num_dense=num_dense, tables=tables, spec=spec,
                             pooling=pooling)
    predictor = Predictor.load(tmp_path / manifest["version_id"], initial_rows=ps_initial_rows)
    features = predictor.featurize({"lines": probe_lines})
    want = torch_logits(model, probe, tables, pooling)
    np.testing.assert_allclose(predictor.logits(features), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(predictor.predict(features), torch.sigmoid(torch.from_numpy(
        want)).numpy(), rtol=1e-5, atol=1e-6)
    # the records get different answers: the comparison is not vacuous
    assert np.unique(want.round(3)).size > len(probe_lines) // 2


def test_serving_knows_every_model_pooling_and_constant_of_training() -> None:
    assert set(FAMILIES) == set(MODELS)
    assert POOLING == POOLING_MODES
    assert DENSE_NORM_EPS == DenseNorm(1).eps


def _dlrm_state() -> dict[str, np.ndarray]:
    torch.manual_seed(0)
    model = ModelConfig(name="dlrm", bottom_mlp=[4], top_mlp=[4]).build(
        sparse_dims={"a": 4, "b": 4}, num_dense=2)
    return {k: v.numpy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("change, match", [
    (lambda s: s.pop("top.2.weight"), "lack top's output layer .*'top.2.weight'"),
    (lambda s: s.pop("top.0.weight"), "lack top's output layer .*'top.0.weight'"),
    (lambda s: s.update(extra=np.zeros(3, np.float32)), r"hold \['extra'\], which the model"),
    (lambda s: s.update({"bottom.0.bias": np.zeros(5, np.float32)}),
     r"'bottom.0.bias' is \(5,\), the model needs \(4,\)"),
    (lambda s: s.pop("top.2.bias"), "lack 'top.2.bias'"),
])
def test_weights_that_do_not_fit_the_model_are_refused(change: Any, match: str) -> None:
    state = _dlrm_state()
    dense_forward({"name": "dlrm"}, sparse_dims={"a": 4, "b": 4}, num_dense=2, state=state)
    change(state)
    with pytest.raises(FailedPrecondition, match=match):
        dense_forward({"name": "dlrm"}, sparse_dims={"a": 4, "b": 4}, num_dense=2,
                      state=state)


@pytest.mark.parametrize("model, match", [
    ({"name": "transformer"}, "model name must be one of"),
    ({"name": "dcnv2", "structure": "tower"}, "model structure must be one of"),
])
def test_an_unknown_model_in_the_manifest_is_refused(model: dict[str, Any], match: str
                                                     ) -> None:
    with pytest.raises(FailedPrecondition, match=match):
        dense_forward(model, sparse_dims={"a": 4}, num_dense=0, state={})


def test_a_version_takes_its_features_in_the_models_order(tmp_path: Path) -> None:
    """The manifest's mappings are written with sorted keys; the model takes "b" before "a"
    as it was trained. A version written before ``feature_order`` takes the spec's order."""
    spec = FeatureSpec(layout="json", dense=["x"], sparse=["b", "a"])
    config = ModelConfig(name="dlrm", bottom_mlp=[4], top_mlp=[4])
    torch.manual_seed(0)
    model = config.build(sparse_dims={"b": 4, "a": 4}, num_dense=1).eval()
    rng = np.random.default_rng(0)
    records = [{"x": float(rng.integers(0, 9)), "b": f"b{rng.integers(0, 5)}",
                "a": f"a{rng.integers(0, 5)}"} for _ in range(16)]
    features = spec.records(records)
    tables = {n: TableRows(name=n, ids=np.unique(features.sparse[n].values),
                           config={"name": n, "dim": 4, "seed": 1},
                           rows=rng.normal(size=(np.unique(features.sparse[n].values).size, 4)
                                           ).astype(np.float32)) for n in ("a", "b")}
    pooled = {n: torch.from_numpy(tables[n].sorted().rows[np.searchsorted(
        tables[n].sorted().ids, features.sparse[n].values)]) for n in ("a", "b")}
    with torch.inference_mode():  # one id per record: its row is the pooled vector
        want = torch.sigmoid(model(pooled, torch.from_numpy(features.dense))).numpy()
    m = write_version(tmp_path, step=1, model=config, state=model.state_dict(),
                      features={"b": "b", "a": "a"}, num_dense=1, tables=tables, spec=spec)
    directory = tmp_path / m["version_id"]
    assert json.loads((directory / "manifest.json").read_text())["feature_order"] == ["b", "a"]
    served = Predictor.load(directory, initial_rows=ps_initial_rows)
    np.testing.assert_allclose(served.predict(served.featurize({"records": records})), want,
                               atol=1e-6)
    manifest = json.loads((directory / "manifest.json").read_text())
    del manifest["feature_order"]  # as versions written before it
    (directory / "manifest.json").write_text(json.dumps(manifest))
    served = Predictor.load(directory, initial_rows=ps_initial_rows)
    np.testing.assert_allclose(served.predict(served.featurize({"records": records})), want,
                               atol=1e-6)
    assert np.unique(want.round(4)).size > 8
