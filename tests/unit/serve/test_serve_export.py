"""Model versions on disk: round trip, row encodings, atomicity, checksums, retention."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from serve_versions import DIMS, MODEL, SPEC, TABLES, MakeVersion, ps_initial_rows, random_tables

from services.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from services.serve.export import (
    list_versions,
    open_tables,
    prune,
    read_manifest,
    tables_from_snapshots,
    version_chain,
    write_version,
)
from services.serve.predictor import Predictor
from services.serve.rows import EmbeddingRows, TableRows


def rows_of(models: Path, manifest: dict, table: str) -> EmbeddingRows:
    chain = version_chain(models, manifest["version_id"])
    return open_tables(models, chain, ps_initial_rows)[table]


def test_manifest_describes_the_version(tmp_path: Path, make_version: MakeVersion) -> None:
    m = make_version(step=7)
    on_disk = read_manifest(tmp_path / "models" / m["version_id"])
    assert on_disk["step"] == 7 and on_disk["format"] == 2
    assert on_disk["model"]["name"] == "dlrm" and on_disk["model"]["bottom_mlp"] == [8, 4]
    assert on_disk["sparse_dims"] == DIMS and on_disk["num_dense"] == 2
    assert on_disk["features"] == {"C1": "C1", "C2": "C2", "C3": "C3"}
    assert on_disk["tables"]["C2"]["config"]["initializer"] == "normal"
    names = set(on_disk["files"])
    assert {"dense.safetensors", "feature_spec.json", "t0-ids.npy", "t0-rows.npy"} <= names
    spec = json.loads((tmp_path / "models" / m["version_id"] / "feature_spec.json").read_text())
    assert spec["buckets"] == {"C2": 50} and spec["hashing"]["C2"]["buckets"] == 50
    ids = np.load(tmp_path / "models" / m["version_id"] / "t0-ids.npy", mmap_mode="r")
    assert isinstance(ids, np.memmap) and bool(np.all(np.diff(ids.astype(np.float64)) > 0))


@pytest.mark.parametrize(("dtype", "tol"), [("float32", 0.0), ("float16", 2e-3), ("int8", None)])
def test_rows_round_trip_in_each_dtype(tmp_path: Path, make_version: MakeVersion, dtype: str,
                                       tol: float | None) -> None:
    m = make_version(row_dtype=dtype)
    for name, table in m["_tables"].items():
        got = rows_of(tmp_path / "models", m, name).lookup(table.ids[::-1])
        want = table.rows[::-1]
        # int8: within half a quantization step of each row's scale
        bound = np.abs(want).max(axis=1, keepdims=True) / 127 / 2 + 1e-7 if tol is None else tol
        assert np.all(np.abs(got - want) <= bound + np.abs(want) * (tol or 0))


def test_unseen_ids_get_the_ps_initial_rows(tmp_path: Path, make_version: MakeVersion) -> None:
    m = make_version()
    table = m["_tables"]["C2"]
    fresh = np.array([5, 2**63 + 11, 123456789], dtype=np.uint64)
    ids = np.concatenate([fresh[:1], table.ids[:3], fresh[1:]])
    got = rows_of(tmp_path / "models", m, "C2").lookup(ids)
    np.testing.assert_array_equal(got[1:4], table.rows[:3])
    np.testing.assert_array_equal(got[[0, 4, 5]], ps_initial_rows(TABLES["C2"], fresh))
    assert np.abs(got[[0, 4, 5]]).sum() > 0


def test_readers_skip_incomplete_directories(tmp_path: Path, make_version: MakeVersion) -> None:
    good = make_version(step=1)
    models = tmp_path / "models"
    (models / ".tmp-v2-abc").mkdir()                       # an export in progress
    (models / "v3-no-manifest").mkdir()                    # rename done by hand, no manifest
    (models / "v4-garbage").mkdir()
    (models / "v4-garbage" / "manifest.json").write_text("{not json")
    (models / "stray-file").write_text("x")
    assert [m["version_id"] for m in list_versions(models)] == [good["version_id"]]


def test_a_corrupt_file_refuses_the_version(tmp_path: Path, make_version: MakeVersion) -> None:
    m = make_version()
    directory = tmp_path / "models" / m["version_id"]
    Predictor.load(directory, initial_rows=ps_initial_rows)  # loads while intact
    path = directory / "t1-rows.npy"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(FailedPrecondition, match="corrupt"):
        Predictor.load(directory, initial_rows=ps_initial_rows)
    (directory / "t1-rows.npy").unlink()
    with pytest.raises(FailedPrecondition, match="cannot be read"):
        Predictor.load(directory, initial_rows=ps_initial_rows)


def test_a_version_without_manifest_cannot_load(tmp_path: Path, make_version: MakeVersion
                                                ) -> None:
    m = make_version()
    directory = tmp_path / "models" / m["version_id"]
    (directory / "manifest.json").unlink()
    with pytest.raises(NotFound):
        Predictor.load(directory, initial_rows=ps_initial_rows)


def test_retention_keeps_the_newest(tmp_path: Path, make_version: MakeVersion) -> None:
    ids = [make_version(step=s)["version_id"] for s in (1, 2, 3)]
    assert prune(tmp_path / "models", 2) == ids[:1]
    last = make_version(step=4, keep=2)["version_id"]
    assert [m["version_id"] for m in list_versions(tmp_path / "models")] == [ids[2], last]
    assert not (tmp_path / "models" / ids[0]).exists()
    with pytest.raises(InvalidArgument):
        prune(tmp_path / "models", 0)


def test_bad_exports_write_nothing(tmp_path: Path) -> None:
    module = MODEL.build(sparse_dims=DIMS, num_dense=2)
    tables = random_tables(np.random.default_rng(0))
    good = dict(step=1, model=MODEL, state=module.state_dict(), features={f: f for f in DIMS},
                num_dense=2, tables=tables, spec=SPEC)
    models = tmp_path / "models"
    wrong_state = {**module.state_dict(), "top.0.weight": torch.zeros(3, 3)}
    for bad in ({"row_dtype": "int4"}, {"state": wrong_state}, {"num_dense": 3},
                {"tables": {k: v for k, v in tables.items() if k != "C3"}},
                {"features": {"C9": "C1"}}, {"step": -1}, {"pooling": "max"},
                {"version_id": "../x"}):
        with pytest.raises(InvalidArgument):
            write_version(models, **{**good, **bad})
    assert not models.exists() or not any(models.iterdir())
    write_version(models, **good, version_id="v1")
    with pytest.raises(AlreadyExists):
        write_version(models, **good, version_id="v1")
    assert [p.name for p in models.iterdir()] == ["v1"]


def test_snapshot_chains_apply_changes_and_tombstones() -> None:
    config = {"name": "t", "dim": 2}

    def snap(ids: list[int], value: float, tomb: list[int] = (), inc: bool = True) -> object:
        return SimpleNamespace(config=config, ids=np.array(ids, np.uint64),
                               rows=np.full((len(ids), 2), value, np.float32),
                               tombstones=np.array(tomb, np.uint64), incremental=inc)

    rows = tables_from_snapshots({"t": [snap([1, 2, 3], 1.0, inc=False), snap([2, 4], 2.0, [3]),
                                        snap([5], 3.0, [4, 1])]})["t"].sorted()
    assert rows.ids.tolist() == [2, 5]
    assert rows.rows[:, 0].tolist() == [2.0, 3.0]
    with pytest.raises(FailedPrecondition):
        tables_from_snapshots({"t": [snap([1], 1.0)]})
    with pytest.raises(InvalidArgument):
        TableRows(name="t", ids=np.array([1, 1], np.uint64), rows=np.zeros((2, 2)),
                  config=config).sorted()
