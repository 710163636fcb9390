"""The head ids' set kernels against numpy: membership, and a layout split by it."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.sharding import ShardedIds
from services.worker.head_kernels import NO_MEMBERS, hash_set, partition


@pytest.mark.parametrize("num_shards", [1, 3])
def test_partition_is_the_layouts_partition_by_membership(num_shards: int) -> None:
    """Each id is head exactly when its key is in the set; the head ids' cell counts and the
    two position lists are those of the layout's own subsets (a count put in the wrong cell
    would send a head id's row to another shard or table)."""
    rng = np.random.default_rng(num_shards)
    tables = {t: np.unique(rng.integers(1, 5_000, 400, dtype=np.uint64)) for t in "abc"}
    layout, _ = ShardedIds.of_tables(tables, num_shards)
    keys = layout.ids ^ (layout.table_index().astype(np.uint64) + np.uint64(1))
    chosen = rng.choice(keys, 150, replace=False)
    is_head = np.empty(keys.size, dtype=bool)
    head_cells, head_at, rest_at = partition(hash_set(chosen), keys, layout.counts.ravel(),
                                             is_head)
    expected = np.isin(keys, chosen)
    np.testing.assert_array_equal(is_head, expected)
    np.testing.assert_array_equal(head_at, np.flatnonzero(expected))
    np.testing.assert_array_equal(rest_at, np.flatnonzero(~expected))
    np.testing.assert_array_equal(head_cells.reshape(layout.counts.shape),
                                  layout.subset(expected).counts)
    np.testing.assert_array_equal(layout.ids[rest_at], layout.subset(~expected).ids)


def test_partition_by_the_empty_set_keeps_every_id_in_the_rest() -> None:
    keys = np.arange(1, 9, dtype=np.uint64)
    is_head = np.ones(keys.size, dtype=bool)
    head_cells, head_at, rest_at = partition(NO_MEMBERS, keys, np.array([5, 3]), is_head)
    assert not is_head.any() and head_at.size == 0 and head_cells.tolist() == [0, 0]
    np.testing.assert_array_equal(rest_at, np.arange(8))
