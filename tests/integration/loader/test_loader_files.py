"""File sources on real files: Criteo (plain/gzip), Avazu, schema CSV, Parquet; bad records;
epochs; and a restart that resumes at the committed position with no row lost."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from services.common.errors import ConfigError, InvalidArgument
from services.loader.hashing import hash_value
from tests.integration.loader.loader_support import drain, ids_of

RAW = {"dense_log1p": False, "dense_clip_min": None, "dense_fill": -1.0}
SPEC = "?dense=2&sparse=2"


def criteo_lines(start: int, n: int) -> list[str]:
    """Row i: label i % 2, dense [i, 2i], categorical c{i % 7} and x{i}."""
    return [f"{i % 2}\t{i}\t{2 * i}\tc{i % 7}\tx{i}" for i in range(start, start + n)]


def write(path, lines: list[str], gz: bool = False) -> None:
    data = ("\n".join(lines) + "\n").encode()
    path.write_bytes(gzip.compress(data) if gz else data)


def row_ids(batches) -> list[int]:
    return sorted(int(v) for b in batches for v in b.dense[:, 0])


async def test_criteo_plain_and_gzip_globs_and_epochs(tmp_path, start_loader):
    write(tmp_path / "day_0.txt", criteo_lines(0, 300))
    write(tmp_path / "day_1.txt.gz", criteo_lines(300, 250), gz=True)
    write(tmp_path / "other.txt", criteo_lines(550, 50))
    spec = f"criteo:{tmp_path}/day_*,{tmp_path}/other.txt{SPEC}"
    loader = await start_loader(source=spec, epochs=2, block_bytes=1500, **RAW)
    batches = await drain(loader.address)
    assert row_ids(batches) == sorted(list(range(600)) * 2)
    assert ids_of(batches[:1], "C2")[:2] == [hash_value("C2", "x0"), hash_value("C2", "x1")]
    assert batches[0].positions == {f"file:e0:{tmp_path}/day_0.txt": (0, 99)}
    assert loader.pipeline.stats()["malformed_total"] == 0
    offsets = loader.source.offsets()
    assert offsets[f"file:e1:{tmp_path}/other.txt"]["read"] == 50


async def test_shuffled_epochs_differ_but_cover_every_row(tmp_path, start_loader):
    write(tmp_path / "a.txt", criteo_lines(0, 400))
    loader = await start_loader(source=f"criteo:{tmp_path}/a.txt{SPEC}", epochs=2,
                                shuffle_buffer=150, seed=7, block_bytes=1000, **RAW)
    batches = await drain(loader.address)
    order = [int(v) for b in batches for v in b.dense[:, 0]]
    assert sorted(order) == sorted(list(range(400)) * 2)
    assert order[:400] != list(range(400)) and order[:400] != order[400:]


async def test_bad_records_are_counted_dead_lettered_and_skipped(tmp_path, start_loader):
    lines = criteo_lines(0, 10)
    lines[2] = "1\t2"                                # wrong column count
    lines[5] = "0\tmany\t3\tc\tx"                    # non-numeric dense value
    bad_bytes = b"1\t1\t1\t\xff\xfe\tx"               # not UTF-8
    data = ("\n".join(lines) + "\n").encode() + bad_bytes + b"\n"
    (tmp_path / "a.txt").write_bytes(data)
    whole = ("\n".join(criteo_lines(100, 40)) + "\n").encode()
    (tmp_path / "b.txt.gz").write_bytes(gzip.compress(whole)[:-30])   # truncated gzip
    write(tmp_path / "c.txt", criteo_lines(200, 5))
    dead = tmp_path / "dead.jsonl"
    loader = await start_loader(source=f"criteo:{tmp_path}/*.txt*{SPEC}", dead_letter=str(dead),
                                block_bytes=200, **RAW)
    batches = await drain(loader.address)
    ids = row_ids(batches)
    assert [i for i in ids if i < 100] == [0, 1, 3, 4, 6, 7, 8, 9]
    assert 100 in ids and max(i for i in ids if 100 <= i < 200) < 139  # the truncated tail
    assert [i for i in ids if i >= 200] == list(range(200, 205))      # the next file is read
    records = [json.loads(line) for line in dead.read_text().splitlines()]
    by_reason = {(r["partition"].rsplit("/", 1)[-1], r["reason"]): r for r in records}
    assert by_reason[("a.txt", "column_count")]["position"] == 2
    assert by_reason[("a.txt", "column_count")]["raw"] == "1\t2"
    assert by_reason[("a.txt", "dense_not_numeric")]["position"] == 5
    assert by_reason[("a.txt", "invalid_utf8")]["position"] == 10
    assert "\\xff" in by_reason[("a.txt", "invalid_utf8")]["raw"]
    assert ("b.txt.gz", "truncated_gzip") in by_reason
    stats = loader.pipeline.stats()
    assert stats["malformed"] == {"column_count": 1, "dense_not_numeric": 1,
                                  "invalid_utf8": 1, "truncated_gzip": 1}


async def test_avazu_header_and_a_file_with_another_header(tmp_path, start_loader):
    header = "id,click,hour,C1,site_id"
    rows = [f"{i},{i % 2},141021{i % 24:02d},100{i % 3},s{i}" for i in range(30)]
    (tmp_path / "a.csv").write_text("\n".join([header, *rows]) + "\n")
    (tmp_path / "b.csv").write_text("id,click,site_id\n1,0,zz\n")
    loader = await start_loader(source=f"avazu:{tmp_path}/*.csv", batch_size=8)
    batches = await drain(loader.address)
    assert sum(b.size for b in batches) == 30
    assert batches[0].feature_names == ["hour", "C1", "site_id"]
    assert batches[0].positions[f"file:e0:{tmp_path}/a.csv"] == (1, 8)  # line 0 is the header
    assert ids_of(batches, "site_id")[:2] == [hash_value("site_id", "s0"),
                                              hash_value("site_id", "s1")]
    assert loader.pipeline.stats()["malformed"] == {"header_mismatch": 1}


async def test_csv_with_schema_file(tmp_path, start_loader):
    schema = tmp_path / "schema.yaml"
    schema.write_text("label: y\ndense: [age]\nsparse: [user, tags]\ndelimiter: '|'\n"
                      "multi_hot: {tags: ';'}\nbuckets: {user: 50}\n")
    (tmp_path / "d.csv").write_text("user|y|age|tags\nu1|1|30|a;b;c\nu2|0||\nu3|1|x|q\n")
    loader = await start_loader(source=f"csv:{tmp_path}/d.csv?schema={schema}", **RAW)
    batches = await drain(loader.address)
    (batch,) = batches
    assert batch.labels.tolist() == [1.0, 0.0] and batch.dense[:, 0].tolist() == [30.0, -1.0]
    assert batch.sparse["tags"].lengths.tolist() == [3, 0]
    assert batch.sparse["user"].values.tolist() == [hash_value("user", "u1", 50),
                                                    hash_value("user", "u2", 50)]
    assert loader.pipeline.stats()["malformed"] == {"dense_not_numeric": 1}


async def test_parquet_types_nulls_and_bad_labels(tmp_path, start_loader):
    table = pa.table({
        "label": pa.array([1, 0, None, 1], pa.int64()),
        "price": pa.array([1.5, None, 2.0, 4.0]),
        "user": pa.array(["u1", None, "u3", ""]),
        "item": pa.array([10, 20, 30, -40], pa.int64()),
        "tags": pa.array([["a", "b"], [], None, ["c"]], pa.list_(pa.string())),
    })
    pq.write_table(table, tmp_path / "p.parquet")
    # without a schema numeric columns are dense, the others sparse
    inferred = await start_loader(source=f"parquet:{tmp_path}/*.parquet", **RAW)
    info = inferred.source.describe()
    assert (info["dense_features"], info["sparse_features"]) == (["price", "item"],
                                                                 ["user", "tags"])
    schema = tmp_path / "schema.yaml"
    schema.write_text("label: label\ndense: [price]\nsparse: [user, item, tags]\n")
    dead = tmp_path / "dead.jsonl"
    loader = await start_loader(source=f"parquet:{tmp_path}/*.parquet?schema={schema}",
                                dead_letter=str(dead), **RAW)
    (batch,) = await drain(loader.address)
    assert batch.feature_names == ["user", "item", "tags"]
    assert batch.labels.tolist() == [1.0, 0.0, 1.0]
    assert batch.dense[:, 0].tolist() == [1.5, -1.0, 4.0]
    assert batch.sparse["user"].lengths.tolist() == [1, 0, 0]  # null and "" are missing
    assert batch.sparse["item"].values.tolist() == [hash_value("item", v)
                                                    for v in ("10", "20", "-40")]
    assert batch.sparse["tags"].values.tolist() == [hash_value("tags", v) for v in "abc"]
    assert batch.sparse["tags"].lengths.tolist() == [2, 0, 1]
    assert batch.positions == {f"file:e0:{tmp_path}/p.parquet": (0, 3)}
    (record,) = [json.loads(line) for line in dead.read_text().splitlines()]
    assert record["position"] == 2 and record["reason"] == "label_not_numeric"


@pytest.mark.parametrize("gz", [False, True])
async def test_restart_resumes_at_the_committed_position(tmp_path, start_loader, gz):
    write(tmp_path / "a.txt", criteo_lines(0, 500), gz=gz)
    write(tmp_path / "b.txt", criteo_lines(500, 300), gz=gz)
    state = tmp_path / "state.json"
    common = dict(source=f"criteo:{tmp_path}/*.txt{SPEC}", state_file=str(state),
                  block_bytes=800, batch_size=50, **RAW)
    first = await start_loader(**common)
    seen = await drain(first.address, limit=7)   # acked: the first 350 rows of a.txt
    await drain(first.address, limit=2, ack=False)  # delivered, never acknowledged
    await first.close()
    saved = json.loads(state.read_text())["partitions"]
    committed = saved[f"file:e0:{tmp_path}/a.txt"]["line"]
    assert 0 < committed <= 350 and not saved[f"file:e0:{tmp_path}/a.txt"]["done"]
    second = await start_loader(**common)
    rest = await drain(second.address)
    assert int(rest[0].dense[0, 0]) == committed  # resumes exactly where it committed
    assert sorted(set(row_ids(seen)) | set(row_ids(rest))) == list(range(800))  # none lost
    assert len(row_ids(rest)) == 800 - committed  # and nothing before the commit again
    await second.close()
    final = json.loads(state.read_text())["partitions"]
    assert all(p["done"] for p in final.values()), final
    third = await start_loader(**common)
    assert await drain(third.address) == []  # everything committed: nothing to read


async def test_file_source_errors(tmp_path, start_loader):
    with pytest.raises(ConfigError, match="matches no files"):
        await start_loader(source=f"criteo:{tmp_path}/none*.txt")
    (tmp_path / "s.json").write_text('{"source": "other", "partitions": {}}')
    write(tmp_path / "a.txt", criteo_lines(0, 3))
    with pytest.raises(ConfigError, match="belongs to source"):
        await start_loader(source=f"criteo:{tmp_path}/a.txt{SPEC}",
                           state_file=str(tmp_path / "s.json"))
    # a file that is not Parquet names itself (was "internal error: ArrowInvalid")
    with pytest.raises(ConfigError, match=r"a\.txt is not a Parquet file: .*magic bytes"):
        await start_loader(source=f"parquet:{tmp_path}/a.txt")


async def test_a_failing_source_ends_worker_streams_with_its_error(tmp_path, start_loader):
    table = pa.table({"label": [1, 0], "pos": pa.array([{"x": 1}, {"x": 2}])})
    pq.write_table(table, tmp_path / "p.parquet")
    schema = tmp_path / "schema.yaml"
    schema.write_text("label: label\nsparse: [pos]\n")
    loader = await start_loader(source=f"parquet:{tmp_path}/p.parquet?schema={schema}")
    with pytest.raises(InvalidArgument, match="has type struct"):
        await drain(loader.address)
    assert not loader.ready()
