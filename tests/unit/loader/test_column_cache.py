"""The parse-once column cache: what it serves is exactly what the parser gives, every row
once an epoch; a file that changed is parsed again; a corrupt entry is never served."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from services.common.errors import ConfigError
from services.loader.cache import MANIFEST, ColumnCache
from services.loader.config import LoaderConfig, SourceSpec
from services.loader.planted import SyntheticDataset, synthetic_profile
from services.loader.sources.files import FileSource

ROWS = 3000


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Planted toy data (two multi-hot features) in Criteo layout, a few bad lines added."""
    out = tmp_path_factory.mktemp("data")
    SyntheticDataset(synthetic_profile("toy", seed=3)).write(out, ROWS, 500)
    with open(out / "train.txt", "ab") as f:
        f.write(b"not a record\n")
    return out


def spec_of(path: Path) -> str:
    return f"criteo:{path}?dense=4&sparse=8&multi_hot=,"


def parsed_rows(spec: str) -> dict[str, np.ndarray]:
    """The file parsed by the loader's own source, as columns (the reference)."""
    source = FileSource(SourceSpec.parse(spec), LoaderConfig(source=spec))
    source.resolve()
    blocks = [b for path in source.files for b, _ in source.file_blocks(path)]
    out = {"labels": np.concatenate([b.labels for b in blocks]),
           "dense": np.concatenate([b.dense for b in blocks])}
    for name in source.schema.sparse:
        out[name + ".values"] = np.concatenate([b.sparse[name].values for b in blocks])
        out[name + ".lengths"] = np.concatenate([b.sparse[name].lengths for b in blocks])
    return out


def served_rows(batches: list) -> dict[str, np.ndarray]:
    out = {"labels": np.concatenate([b.labels for b in batches]),
           "dense": np.concatenate([b.dense for b in batches])}
    for name in batches[0].sparse:
        out[name + ".values"] = np.concatenate([b.sparse[name].values for b in batches])
        out[name + ".lengths"] = np.concatenate([b.sparse[name].lengths for b in batches])
    return out


def test_the_cache_serves_exactly_what_the_parser_gives(data: Path, tmp_path: Path) -> None:
    spec = spec_of(data / "train.txt")
    cached = ColumnCache(tmp_path).prepare(spec)
    assert cached.built == 1 and cached.rows == ROWS
    manifest = (Path(cached.entries[0]) / MANIFEST).read_text()
    assert '"malformed": 1' in manifest  # the bad line is counted, not cached
    batches = list(cached.batches(256, seed=None))
    assert [b.size for b in batches] == [256] * (ROWS // 256) + [ROWS % 256]
    want, got = parsed_rows(spec), served_rows(batches)
    assert want.keys() == got.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    assert set(cached.open()[0].one_id) == {f"C{i}" for i in range(1, 7)}  # C7, C8 multi-hot


def test_a_file_without_dense_columns_is_cached_and_served(tmp_path: Path) -> None:
    path = tmp_path / "nodense.txt"
    path.write_text("1\tu1\ta,b\n0\tu2\t\n1\tu1\tc\n")
    spec = f"criteo:{path}?dense=0&sparse=2&multi_hot=,"
    cached = ColumnCache(tmp_path / "cache").prepare(spec)
    assert cached.rows == 3
    again = ColumnCache(tmp_path / "cache").prepare(spec)  # opened from the manifest
    assert again.built == 0 and again.open()[0].dense.shape == (3, 0)
    want, got = parsed_rows(spec), served_rows(list(again.batches(2, seed=None)))
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_split_last_holds_out_the_last_rows_of_the_files_end_to_end(tmp_path: Path) -> None:
    # two files of 5 and 3 rows, the label column numbering the rows 0..7 in file order
    (tmp_path / "a.txt").write_text("".join(f"{i}\t{i}\tu{i}\n" for i in range(5)))
    (tmp_path / "b.txt").write_text("".join(f"{i}\t{i}\tu{i}\n" for i in range(5, 8)))
    cached = ColumnCache(tmp_path / "cache").prepare(
        f"criteo:{tmp_path}/*.txt?dense=1&sparse=1")
    train, validation = cached.split_last(0.5)  # rows 4..7 cross the files' end
    assert (train.rows, validation.rows, cached.rows) == (4, 4, 8)

    def labels(data, seed):
        return np.concatenate([b.labels for b in data.batches(3, seed=seed, epochs=2)])

    assert labels(validation, None).tolist() == [4, 5, 6, 7] * 2
    for seed in (None, 0, 1):
        assert sorted(labels(train, seed).tolist()) == sorted([0, 1, 2, 3] * 2)
    assert sorted(labels(validation, 3).tolist()) == sorted([4, 5, 6, 7] * 2)
    inner, last = train.split_last(0.25)  # a window split again stays inside it
    assert labels(last, None).tolist() == [3, 3] and labels(inner, None).max() == 2
    for bad in (0.0, 1.0, 0.01, 1.5):
        with pytest.raises(ConfigError, match="validation fraction"):
            cached.split_last(bad)


def test_each_epoch_is_a_shuffle_and_the_ranks_split_the_batches(data: Path, tmp_path: Path
                                                                 ) -> None:
    cached = ColumnCache(tmp_path).prepare(spec_of(data / "train.txt"))
    ranks = [list(cached.batches(200, rank=r, world=2, epochs=2, seed=5)) for r in range(2)]
    every = sorted([b for rank in ranks for b in rank], key=lambda b: b.batch_id)
    assert [b.batch_id for b in every] == list(range(len(every)))  # each batch to one rank
    assert all(b.batch_id % 2 == r for r, rank in enumerate(ranks) for b in rank)
    per_epoch = -(-ROWS // 200)
    file_order = served_rows(list(cached.batches(200, seed=None)))
    epochs = [served_rows(every[:per_epoch]), served_rows(every[per_epoch:])]
    for rows in epochs:  # each row once an epoch, not in the file's order
        assert sorted_rows(rows) == sorted_rows(file_order)
        assert not np.array_equal(rows["dense"], file_order["dense"])
    assert not np.array_equal(epochs[0]["dense"], epochs[1]["dense"])


def sorted_rows(rows: dict[str, np.ndarray]) -> list[tuple]:
    """Each single-hot sample as a tuple (label, dense, C1..C6 ids), sorted."""
    ids = np.stack([rows[f"C{i}.values"] for i in range(1, 7)], axis=1)
    return sorted(zip(rows["labels"].tolist(), map(tuple, rows["dense"].tolist()),
                      map(tuple, ids.tolist()), strict=True))


def test_batches_run_on_across_files(data: Path, tmp_path: Path) -> None:
    spec = f"criteo:{data}/t*.txt?dense=4&sparse=8&multi_hot=,"  # test.txt then train.txt
    cached = ColumnCache(tmp_path).prepare(spec)
    assert len(cached.entries) == 2 and cached.rows == ROWS + 500
    batches = list(cached.batches(1000, seed=None))
    assert [b.size for b in batches] == [1000, 1000, 1000, 500]
    for key, want in parsed_rows(spec).items():
        np.testing.assert_array_equal(served_rows(batches)[key], want, err_msg=key)


def test_a_file_that_changed_is_parsed_again(data: Path, tmp_path: Path) -> None:
    path = tmp_path / "day.txt"
    lines = (data / "train.txt").read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:1000]))
    cache = ColumnCache(tmp_path / "cache")
    assert cache.prepare(spec_of(path)).rows == 1000
    again = cache.prepare(spec_of(path))
    assert again.built == 0 and again.rows == 1000  # unchanged: read, not parsed
    path.write_bytes(b"".join(lines[:1500]))
    os.utime(path, ns=(1, 1))  # even with an older modification time
    changed = cache.prepare(spec_of(path))
    assert changed.built == 1 and changed.rows == 1500
    for key, want in parsed_rows(spec_of(path)).items():
        np.testing.assert_array_equal(served_rows(list(changed.batches(512, seed=None)))[key],
                                      want, err_msg=key)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "manifest"])
def test_a_corrupt_entry_is_never_served(data: Path, tmp_path: Path, damage: str) -> None:
    spec = spec_of(data / "train.txt")
    cache = ColumnCache(tmp_path)
    entry = Path(cache.prepare(spec).entries[0])
    column = entry / "dense.bin"
    if damage == "flip":
        raw = bytearray(column.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        column.write_bytes(bytes(raw))
    elif damage == "truncate":
        column.write_bytes(column.read_bytes()[:-4])
    elif damage == "delete":
        column.unlink()
    else:
        (entry / MANIFEST).write_text("{not json")
    rebuilt = cache.prepare(spec)
    assert rebuilt.built == 1
    for key, want in parsed_rows(spec).items():
        np.testing.assert_array_equal(served_rows(list(rebuilt.batches(512, seed=None)))[key],
                                      want, err_msg=key)


def test_bad_requests_are_refused(data: Path, tmp_path: Path) -> None:
    cache = ColumnCache(tmp_path)
    with pytest.raises(ConfigError, match="file sources"):
        cache.prepare("synthetic:1000")
    with pytest.raises(ConfigError, match="matches no files"):
        cache.prepare(f"criteo:{tmp_path}/none*.txt")
    cached = cache.prepare(spec_of(data / "train.txt"))
    for bad in ({"batch_size": 0}, {"batch_size": 8, "rank": 2, "world": 2},
                {"batch_size": 8, "epochs": 0}):
        with pytest.raises(ConfigError, match="bad batches"):
            next(cached.batches(**bad))
