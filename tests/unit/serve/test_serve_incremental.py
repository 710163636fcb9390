"""Incremental model versions: changed rows and tombstones on top of a base."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from serve_versions import DIMS, MODEL, SPEC, TABLES, ps_initial_rows

from services.common.errors import FailedPrecondition, InvalidArgument
from services.serve.export import list_versions, open_tables, prune, version_chain, write_version
from services.serve.predictor import Predictor
from services.serve.rows import TableRows

STATE = MODEL.build(sparse_dims=DIMS, num_dense=2).state_dict()


def write(models: Path, version_id: str, rows: dict[str, dict[int, np.ndarray]], *,
          base: str | None = None, row_dtype: str = "float32", keep: int | None = None
          ) -> dict:
    tables = {}
    for name, config in TABLES.items():
        ids = np.array(sorted(rows[name]), dtype=np.uint64)
        values = np.array([rows[name][i] for i in ids.tolist()], dtype=np.float32).reshape(
            -1, config["dim"])
        tables[name] = TableRows(name=name, ids=ids, rows=values, config=config)
    return write_version(models, step=int(version_id[1:]), model=MODEL, state=STATE,
                         features={f: f for f in DIMS}, num_dense=2, tables=tables, spec=SPEC,
                         version_id=version_id, base=base, row_dtype=row_dtype, keep=keep)


def random_rows(rng: np.random.Generator, n: int = 100) -> dict[str, dict[int, np.ndarray]]:
    return {name: {int(i): rng.normal(size=c["dim"]).astype(np.float32)
                   for i in rng.choice(10_000, size=n, replace=False)}
            for name, c in TABLES.items()}


def evolve(rng: np.random.Generator, rows: dict[str, dict[int, np.ndarray]]
           ) -> dict[str, dict[int, np.ndarray]]:
    """5 rows changed, 3 deleted and 4 added per table."""
    out = {}
    for name, table in rows.items():
        new = dict(table)
        ids = sorted(new)
        for i in ids[:5]:
            new[i] = new[i] + 1.0
        for i in ids[5:8]:
            del new[i]
        for i in range(20_000, 20_004):
            new[i] = rng.normal(size=TABLES[name]["dim"]).astype(np.float32)
        out[name] = new
    return out


def assert_serves(models: Path, version_id: str, rows: dict[str, dict[int, np.ndarray]],
                  deleted: dict[str, list[int]] | None = None) -> None:
    tables = open_tables(models, version_chain(models, version_id), ps_initial_rows)
    for name, table in rows.items():
        ids = np.array(sorted(table), dtype=np.uint64)
        np.testing.assert_array_equal(tables[name].lookup(ids),
                                      np.stack([table[i] for i in ids.tolist()]))
        np.testing.assert_array_equal(tables[name].live_ids(), ids)
        gone = np.array((deleted or {}).get(name, []), dtype=np.uint64)
        np.testing.assert_array_equal(tables[name].lookup(gone),
                                      ps_initial_rows(TABLES[name], gone).reshape(-1, DIMS[name]))


def test_an_incremental_version_holds_changes_and_tombstones(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    v1_rows = random_rows(rng)
    v2_rows = evolve(rng, v1_rows)
    full = write(tmp_path, "v1", v1_rows)
    inc = write(tmp_path, "v2", v2_rows, base="v1")
    assert inc["base"] == "v1" and full["base"] is None
    for entry in inc["tables"].values():
        assert (entry["rows"], entry["tombstones"]) == (9, 3)  # 5 changed + 4 new, 3 deleted
    deleted = {n: sorted(t)[5:8] for n, t in v1_rows.items()}
    assert_serves(tmp_path, "v2", v2_rows, deleted)
    assert_serves(tmp_path, "v1", v1_rows)  # the base is untouched
    v3_rows = evolve(rng, v2_rows)
    for name in v3_rows:  # an id deleted in v2 comes back in v3
        v3_rows[name][deleted[name][0]] = np.ones(DIMS[name], np.float32)
    write(tmp_path, "v3", v3_rows, base="v2")
    assert_serves(tmp_path, "v3", v3_rows)
    predictor = Predictor.load(tmp_path / "v3", initial_rows=ps_initial_rows)
    assert predictor.describe()["base"] == "v2"
    bytes_of = {m["version_id"]: sum(f["bytes"] for f in m["files"].values())
                for m in list_versions(tmp_path)}
    assert bytes_of["v2"] < bytes_of["v1"]


def test_unchanged_rows_are_not_written_again_in_int8(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    rows = random_rows(rng)
    write(tmp_path, "v1", rows, row_dtype="int8")
    same = write(tmp_path, "v2", rows, base="v1", row_dtype="int8")
    assert all(e["rows"] == 0 and e["tombstones"] == 0 for e in same["tables"].values())
    with pytest.raises(InvalidArgument, match="stores int8"):
        write(tmp_path, "v3", rows, base="v1", row_dtype="float32")


def test_retention_keeps_the_bases_of_kept_versions(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    rows = random_rows(rng)
    write(tmp_path, "v1", rows)
    write(tmp_path, "v2", evolve(rng, rows), base="v1")
    assert prune(tmp_path, 1) == []  # v2 needs v1
    write(tmp_path, "v3", rows, keep=1)  # a full version: the chain can go
    assert [m["version_id"] for m in list_versions(tmp_path)] == ["v3"]


def test_a_version_whose_base_is_gone_is_refused(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    rows = random_rows(rng)
    write(tmp_path, "v1", rows)
    write(tmp_path, "v2", evolve(rng, rows), base="v1")
    shutil.rmtree(tmp_path / "v1")
    with pytest.raises(FailedPrecondition, match="missing"):
        Predictor.load(tmp_path / "v2", initial_rows=ps_initial_rows)
    with pytest.raises(InvalidArgument):
        write(tmp_path, "v3", rows, base="v1/../v2")



def corrupt(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-1] + b"\x01")


def test_a_base_checked_once_is_not_checked_again_but_a_new_version_is(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    rows = random_rows(rng)
    write(tmp_path, "v1", rows)
    seen: set[str] = set()
    Predictor.load(tmp_path / "v1", initial_rows=ps_initial_rows, verified=seen)
    write(tmp_path, "v2", evolve(rng, rows), base="v1")
    corrupt(tmp_path / "v1" / "t0-rows.npy")  # after v1 was checked
    Predictor.load(tmp_path / "v2", initial_rows=ps_initial_rows, verified=set(seen))
    with pytest.raises(FailedPrecondition, match="corrupt"):  # a process that never saw v1
        Predictor.load(tmp_path / "v2", initial_rows=ps_initial_rows, verified=set())
    corrupt(tmp_path / "v2" / "t1-rows.npy")
    with pytest.raises(FailedPrecondition, match="corrupt"):  # v2 itself is checked
        Predictor.load(tmp_path / "v2", initial_rows=ps_initial_rows, verified=set(seen))
