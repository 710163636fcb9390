"""A shard's multi-table requests (several tables' ids one after the other, ``counts`` per
table): a bad request is a clear error with nothing changed; one gradient array for the
whole request is checked whole and applied as the tables' own pushes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from services.common.errors import InvalidArgument, NotFound
from services.ps.config import PSConfig
from services.ps.shard import Shard
from services.ps.tables import OptimizerConfig, TableConfig

DIM = 4


def shard() -> Shard:
    opt = OptimizerConfig(kind="rowwise_adagrad", lr=0.1)
    return Shard(PSConfig(tables=[
        TableConfig(name="a", dim=DIM, optimizer=opt), TableConfig(name="b", dim=DIM, optimizer=opt),
        TableConfig(name="wide", dim=DIM + 1, optimizer=opt)]))


IDS = np.array([1, 2, 3, 7, 8], dtype=np.uint64)  # a: 1, 2, 3; b: 7, 8


def digests(s: Shard) -> dict[str, str]:
    return {name: t.content_digest() for name, t in s.tables.items()}


@pytest.mark.parametrize(("tables", "counts", "grads", "message"), [
    (["a", "a"], [3, 2], None, "names a table twice"),
    (["a", "b"], [5], None, "1 counts for 2 tables"),
    (["a", "b"], [6, -1], None, "must not be negative"),
    (["a", "b"], [3, 3], None, "add up to 6 but there are 5"),
    (["a", "wide"], [3, 2], None, "must have one dim"),
    ([], [], None, "at least one table"),
    (["a", "b"], [3, 2], np.ones((4, DIM), np.float32), r"grads must be floats \(5 ids, dim 4\)"),
    (["a", "b"], [3, 2], np.ones((5, DIM + 1), np.float32), r"grads must be floats \(5 ids, dim 4\)"),
    (["a", "b"], [3, 2], np.ones((5, DIM), np.int32), "grads must be floats"),
    (["a", "b"], [3, 2], [np.ones((3, DIM), np.float32)], "1 gradient arrays for 2 tables"),
    (["a", "b"], [3, 2], [np.ones((3, DIM), np.float32), np.ones((2, 1), np.float32)],
     "table b: grads have dim 1"),
])
def test_a_bad_multi_table_request_is_refused_with_nothing_changed(
        tables: list[str], counts: list[int], grads: Any, message: str) -> None:
    s = shard()
    s.lookup_many_sync(["a", "b"], [3, 2], IDS)  # the rows exist
    before = digests(s)
    with pytest.raises(InvalidArgument, match=message):
        if grads is None:
            s.lookup_many_sync(tables, counts, IDS)
        else:
            s.push_many_sync(tables, counts, IDS, grads)
    if grads is None:
        with pytest.raises(InvalidArgument, match=message):
            s.push_many_sync(tables, counts, IDS, np.ones((IDS.size, DIM), np.float32))
    assert digests(s) == before
    with pytest.raises(NotFound, match="'nope'"):
        s.push_many_sync(["a", "nope"], [3, 2], IDS, np.ones((5, DIM), np.float32))
    assert digests(s) == before


def test_one_gradient_array_is_applied_as_each_tables_own_push() -> None:
    """The whole request's float64 gradients (cast once) against the same float32 gradients
    pushed table by table: the same rows."""
    whole, apart = shard(), shard()
    for s in (whole, apart):
        s.lookup_many_sync(["a", "b"], [3, 2], IDS)
    grads = np.random.default_rng(3).normal(size=(IDS.size, DIM))
    result = whole.push_many_sync(["a", "b"], [3, 2], IDS, grads)
    apart.push_sync("a", IDS[:3], grads[:3].astype(np.float32))
    apart.push_sync("b", IDS[3:], grads[3:].astype(np.float32))
    assert result.applied == 5
    assert digests(whole) == digests(apart)
    np.testing.assert_array_equal(whole.lookup_many_sync(["b", "a"], [2, 3], IDS[[3, 4, 0, 1, 2]]),
                                  apart.lookup_many_sync(["b", "a"], [2, 3], IDS[[3, 4, 0, 1, 2]]))
