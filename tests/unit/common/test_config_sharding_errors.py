from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from enum import StrEnum

import grpc
import numpy as np
import pytest

from services.common.config import add_flags, config_to_dict, flag_values, from_dict, load_config
from services.common.errors import (
    ConfigError,
    Internal,
    NotFound,
    StaleEpoch,
    Unavailable,
    WrongShard,
    error_from_grpc,
    error_from_http,
    error_named,
)
from services.common.sharding import (
    ShardedIds,
    mix64,
    mix64_scalar,
    place_ids,
    rows_at,
    shard_of,
    split_by_shard,
)


class Colour(StrEnum):
    RED = "red"
    BLUE = "blue"


@dataclass(kw_only=True, slots=True)
class Inner:
    size: int = 1


@dataclass(kw_only=True, slots=True)
class Demo:
    port: int = field(default=1, metadata={"help": "a port"})
    ratio: float = 0.5
    name: str | None = None
    verbose: bool = False
    colour: Colour = Colour.RED
    hosts: list[str] = field(default_factory=list)
    inner: Inner = field(default_factory=Inner)
    items: list[Inner] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.port < 0:
            raise ValueError("port must be >= 0")


def test_precedence_yaml_env_flags(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("port: 5\nratio: 0.25\nname: yaml\ninner: {size: 3}\nitems: [{size: 2}]\n")
    env = {"PERSIMMON_DEMO_RATIO": "0.75", "PERSIMMON_DEMO_VERBOSE": "yes",
           "PERSIMMON_DEMO_HOSTS": "a:1,b:2", "OTHER": "x"}
    cfg = load_config(Demo, yaml_path=path, env_prefix="PERSIMMON_DEMO_", environ=env,
                      flags={"port": "9", "name": None})
    assert cfg.port == 9 and cfg.ratio == 0.75 and cfg.name == "yaml" and cfg.verbose is True
    assert cfg.hosts == ["a:1", "b:2"] and cfg.inner.size == 3 and cfg.items == [Inner(size=2)]
    assert config_to_dict(cfg)["colour"] == "red"


@pytest.mark.parametrize("data,match", [
    ({"prot": 1}, "unknown keys \\['prot'\\]"),
    ({"port": "x"}, "expected int"),
    ({"port": -1}, "port must be >= 0"),
    ({"verbose": "maybe"}, "expected a boolean"),
    ({"colour": "green"}, "not one of"),
    ({"inner": {"sise": 1}}, "config.inner: unknown keys"),
    ({"port": True}, "expected int"),
])
def test_bad_config_is_an_error(data, match):
    with pytest.raises(ConfigError, match=match):
        from_dict(Demo, data)


def test_unknown_env_key_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="PERSIMMON_DEMO_PROT"):
        load_config(Demo, env_prefix="PERSIMMON_DEMO_", environ={"PERSIMMON_DEMO_PROT": "1"})
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(Demo, yaml_path=bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(Demo, yaml_path=tmp_path / "missing.yaml")


def test_flags_are_generated_from_fields():
    parser = argparse.ArgumentParser()
    add_flags(parser, Demo)
    args = parser.parse_args(["--port", "7", "--hosts", "x,y"])
    assert flag_values(Demo, args) == {"port": "7", "hosts": "x,y"}
    assert from_dict(Demo, flag_values(Demo, args)).hosts == ["x", "y"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--inner", "3"])  # nested settings come from YAML only


def test_shard_of_is_stable_balanced_and_vectorised():
    ids = np.arange(100_000, dtype=np.uint64)
    shards = shard_of(ids, 4)
    assert shards.dtype == np.int64 and set(np.unique(shards)) == {0, 1, 2, 3}
    counts = np.bincount(shards)
    assert counts.min() > 0.95 * 25_000
    assert int(shard_of(12345, 4)) == int(shards[12345])
    assert shard_of(np.array([2**64 - 1], np.uint64), 7)[0] < 7
    np.testing.assert_array_equal(shard_of(ids, 1), 0)
    with pytest.raises(ValueError):
        shard_of(ids, 0)


def test_split_by_shard_partitions_positions():
    ids = np.random.default_rng(0).integers(0, 2**63, size=1000, dtype=np.uint64)
    parts = split_by_shard(ids, 3)
    assert sorted(np.concatenate(parts).tolist()) == list(range(1000))
    for k, pos in enumerate(parts):
        assert (shard_of(ids[pos], 3) == k).all()


@pytest.mark.parametrize("num_shards", [1, 2, 3, 5])
def test_place_ids_dedups_per_table_and_groups_by_shard_then_table(num_shards):
    rng = np.random.default_rng(num_shards)
    shared = rng.integers(0, 2**64 - 1, 40, dtype=np.uint64)  # the same ids in both tables
    segments = [rng.choice(shared, 300), rng.choice(shared, 200), shared[:7],
                np.empty(0, dtype=np.uint64)]
    owners = [0, 1, 0, 1]
    layout, inverse = place_ids(segments, owners, ["a", "b"], num_shards)
    values = np.concatenate(segments)
    np.testing.assert_array_equal(layout.ids[inverse], values)  # every id finds itself
    assert layout.counts.shape == (num_shards, 2)
    bounds = layout.bounds
    start = 0
    for k in range(num_shards):
        assert bounds[k] == start
        for j in range(2):
            part = layout.ids[start:start + layout.counts[k, j]]
            assert (shard_of(part, num_shards) == k).all()
            mine = np.concatenate([s for s, o in zip(segments, owners, strict=True) if o == j])
            mine = mine[shard_of(mine, num_shards) == k]
            _, first = np.unique(mine, return_index=True)
            # deduped within the table, in the order the ids first appear in its segments
            np.testing.assert_array_equal(part, mine[np.sort(first)])
            start += part.size
    for j, table in enumerate(("a", "b")):
        mine = np.concatenate([s for s, o in zip(segments, owners, strict=True) if o == j])
        assert sorted(layout.table_ids(table).tolist()) == sorted(set(mine.tolist()))


def test_sharded_ids_of_tables_puts_every_id_back():
    tables = {"x": np.array([9, 4, 2**63], np.uint64), "y": np.array([4], np.uint64),
              "none": np.empty(0, np.uint64)}
    layout, where = ShardedIds.of_tables(tables, 2)
    assert layout.ids.size == 4 and layout.tables == ("x", "y", "none")
    for table, ids in tables.items():
        np.testing.assert_array_equal(layout.ids[where[table]], ids)
    with pytest.raises(ValueError):
        place_ids([np.array([1], np.uint64)], [0], ["t"], 0)


def test_numba_mixer_equals_numpy_mixer():
    ids = np.array([0, 1, 2**63, 2**64 - 1, 12345], dtype=np.uint64)
    assert [int(mix64_scalar(np.uint64(i))) for i in ids] == mix64(ids).tolist()


def test_error_mappings_are_consistent():
    err = WrongShard("x")
    assert err.grpc_code == grpc.StatusCode.INVALID_ARGUMENT and err.http_status == 400
    assert isinstance(error_from_grpc(grpc.StatusCode.NOT_FOUND, "m"), NotFound)
    assert isinstance(error_from_http(404, {"message": "m"}), NotFound)
    assert type(error_from_grpc(grpc.StatusCode.DATA_LOSS, "m")).__name__ == "Internal"


@pytest.mark.parametrize(("name", "code", "expected"), [
    ("StaleEpoch", "FAILED_PRECONDITION", StaleEpoch),  # a subclass, not its status's class
    ("StaleEpoch", "junk", StaleEpoch),  # the name decides when it is known
    ("SomeoneElsesError", "UNAVAILABLE", Unavailable),  # else the status
    ("error_named", "NOT_FOUND", NotFound),  # a name of the module that is no error class
    ("Exception", "junk", Internal),  # nor a class outside the hierarchy
    ("junk", "_member_names_", Internal),  # an attribute of StatusCode that is no member
    ("junk", "DATA_LOSS", Internal),  # a status with no class of its own
])
def test_a_reported_error_is_its_class_when_known_else_its_status_else_internal(
        name, code, expected):
    error = error_named(name, code, "why")
    assert type(error) is expected and error.message == "why"


def test_rows_at_is_a_view_of_one_run_of_positions_and_a_gather_of_any_other() -> None:
    """A client's rows per table: with one shard each table's ids are one run of the layout
    (a view, no copy of the rows); with several shards they are spread (gathered)."""
    ids = {"a": np.array([9, 4, 7], dtype=np.uint64), "b": np.array([5, 1], dtype=np.uint64)}
    for shards in (1, 3):
        layout, where = ShardedIds.of_tables(ids, shards)
        rows = np.arange(layout.ids.size * 2, dtype=np.float32).reshape(-1, 2)
        for table, positions in where.items():
            got = rows_at(rows, positions)
            np.testing.assert_array_equal(got, rows[positions])
            np.testing.assert_array_equal(layout.ids[positions], ids[table])
            assert np.shares_memory(got, rows) == (shards == 1)
    rows = np.arange(12, dtype=np.float32).reshape(6, 2)
    for positions in ([2, 3, 4], [4, 3, 2], [1, 3, 2], [0, 2, 3], [5], []):
        where = np.array(positions, dtype=np.int64)
        np.testing.assert_array_equal(rows_at(rows, where), rows[where])


def test_a_lookup_layout_of_one_shard_is_the_ids_as_given() -> None:
    """``dedup=False`` (lookups): on one shard the layout of unique ids is the one that
    dedup gives, without hashing; an id given twice is laid out twice (its row read twice),
    never merged with another table's id of the same value."""
    ids = {"a": np.array([9, 4, 7], dtype=np.uint64), "b": np.array([4, 1], dtype=np.uint64)}
    plain, where = ShardedIds.of_tables(ids, 1, dedup=False)
    deduped, where_deduped = ShardedIds.of_tables(ids, 1)
    assert plain.tables == deduped.tables
    np.testing.assert_array_equal(plain.ids, deduped.ids)
    np.testing.assert_array_equal(plain.counts, deduped.counts)
    for table in ids:
        np.testing.assert_array_equal(where[table], where_deduped[table])
    twice, where = ShardedIds.of_tables({"a": np.array([3, 3, 5], dtype=np.uint64)}, 1,
                                        dedup=False)
    np.testing.assert_array_equal(twice.ids[where["a"]], [3, 3, 5])
    assert twice.counts.tolist() == [[3]]
