"""Dedup and pooling: against a naive loop and against torch.nn.EmbeddingBag, forward and grads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.errors import InvalidArgument
from services.worker.pooling import plan_batch, pool, pool_batch


def _jagged(rng: np.random.Generator, batch: int, max_len: int, vocab: int):
    lengths = rng.integers(0, max_len + 1, batch).astype(np.int32)
    values = rng.integers(0, vocab, int(lengths.sum())).astype(np.uint64)
    return values, lengths


def _naive_pool(table: np.ndarray, values: np.ndarray, lengths: np.ndarray, mode: str):
    out = np.zeros((lengths.size, table.shape[1]), dtype=np.float64)
    pos = 0
    for b, n in enumerate(lengths):
        for i in range(pos, pos + n):
            out[b] += table[values[i]]
        if mode == "mean" and n:
            out[b] /= n
        pos += n
    return out


def _group_rows(plan, weights: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Each group's rows from full per-table weight matrices, aligned with its layout."""
    out = []
    for g in plan.groups:
        parts, start = [], 0
        for k in range(g.layout.num_shards):
            for j, table in enumerate(g.layout.tables):
                n = g.layout.counts[k, j]
                parts.append(weights[table][g.layout.ids[start:start + n].astype(np.int64)])
                start += n
        out.append(np.concatenate(parts))
    return out


@pytest.mark.parametrize("num_shards", [1, 2, 3])
def test_plan_dedups_per_table_and_inverse_rebuilds_ids(num_shards: int) -> None:
    rng = np.random.default_rng(0)
    a = _jagged(rng, 8, 4, 10)
    b = _jagged(rng, 8, 3, 10)
    c = _jagged(rng, 8, 2, 1000)
    plan = plan_batch({"a": a, "b": b, "c": c}, table_of={"a": "shared", "b": "shared", "c": "c"},
                      num_shards=num_shards)
    assert set(plan.unique) == {"shared", "c"} and len(plan.groups) == 1
    shared = plan.unique["shared"]
    assert shared.dtype == np.uint64 and np.unique(shared).size == shared.size
    np.testing.assert_array_equal(np.sort(shared), np.unique(np.concatenate([a[0], b[0]])))
    group = plan.groups[0]
    for name, (values, lengths) in {"a": a, "b": b, "c": c}.items():
        fp = plan.features[name]
        np.testing.assert_array_equal(group.layout.ids[fp.inverse], values)
        np.testing.assert_array_equal(fp.offsets, np.r_[0, np.cumsum(lengths)[:-1]])
    np.testing.assert_array_equal(group.layout.ids[group.inverse],
                                  np.concatenate([a[0], b[0], c[0]]))
    assert plan.batch_size == 8
    assert plan.num_ids() == a[0].size + b[0].size + c[0].size
    assert plan.num_unique() == shared.size + plan.unique["c"].size


def test_plan_keeps_groups_apart() -> None:
    ids = (np.array([1, 2, 2], np.uint64), np.array([1, 2]))
    plan = plan_batch({"x": ids, "y": ids}, groups=[["y"], ["x"]], num_shards=2)
    assert [g.features for g in plan.groups] == [("y",), ("x",)]
    assert [plan.features[f].group for f in ("x", "y")] == [1, 0]
    with pytest.raises(InvalidArgument, match="in no group"):
        plan_batch({"x": ids, "y": ids}, groups=[["x"]])


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_pool_matches_naive_loop_including_empty_samples(mode: str) -> None:
    rng = np.random.default_rng(1)
    table = rng.standard_normal((20, 5))
    _, lengths = _jagged(rng, 12, 4, 20)
    lengths[3] = 0
    values = rng.integers(0, 20, int(lengths.sum())).astype(np.uint64)
    plan = plan_batch({"f": (values, lengths)}, num_shards=2)
    out = pool_batch(plan, _group_rows(plan, {"f": table}), mode=mode).pooled["f"]
    np.testing.assert_allclose(out.detach().numpy(), _naive_pool(table, values, lengths, mode),
                               rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(out[3]) == 0


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 9), max_len=st.integers(0, 6), vocab=st.integers(1, 30),
       modes=st.sampled_from([("sum", "sum"), ("mean", "mean"), ("sum", "mean")]),
       shards=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_forward_and_row_grads_equal_embedding_bag(batch: int, max_len: int, vocab: int,
                                                   modes: tuple[str, str], shards: int,
                                                   seed: int) -> None:
    """Two features of one table, pooled by one call (same mode) or one each (mixed)."""
    rng = np.random.default_rng(seed)
    features = {"f": _jagged(rng, batch, max_len, vocab), "g": _jagged(rng, batch, max_len, vocab)}
    torch.manual_seed(seed)
    weight = torch.randn(vocab, 3, requires_grad=True)
    upstream = {f: torch.randn(batch, 3) for f in features}
    mode = dict(zip(features, modes, strict=True))
    refs = {}
    for f, (values, lengths) in features.items():
        offsets = torch.from_numpy(np.r_[0, np.cumsum(lengths)[:-1]].astype(np.int64))
        refs[f] = F.embedding_bag(torch.from_numpy(values.astype(np.int64)), weight, offsets,
                                  mode=mode[f])
    sum((refs[f] * upstream[f]).sum() for f in features).backward()

    plan = plan_batch(features, table_of={"f": "t", "g": "t"}, num_shards=shards)
    pb = pool_batch(plan, _group_rows(plan, {"t": weight.detach().numpy()}), mode=mode)
    sum((pb.pooled[f] * upstream[f]).sum() for f in features).backward()

    for f in features:
        torch.testing.assert_close(pb.pooled[f], refs[f].detach())
    uniq = plan.groups[0].layout.ids.astype(np.int64)
    np.testing.assert_allclose(pb.row_grads()[0], weight.grad.numpy()[uniq], rtol=1e-5,
                               atol=1e-6)
    # ids not in the batch get no gradient in the reference either
    untouched = np.setdiff1d(np.arange(vocab), uniq)
    assert np.all(weight.grad.numpy()[untouched] == 0)


def test_features_pooled_in_one_call_are_separate_tensors_with_exact_grads() -> None:
    """Three features of one group pool in one call into three tensors; a feature the loss
    never uses passes no gradient to the rows."""
    rng = np.random.default_rng(3)
    features = {f: _jagged(rng, 6, 4, 12) for f in ("a", "b", "c")}
    table = rng.standard_normal((12, 4)).astype(np.float32)
    plan = plan_batch(features, table_of=dict.fromkeys(features, "t"), num_shards=2)
    pb = pool_batch(plan, _group_rows(plan, {"t": table}), mode="mean")
    assert len({t.data_ptr() for t in pb.pooled.values()}) == 3
    assert all(t.shape == (6, 4) and t.is_contiguous() for t in pb.pooled.values())
    (pb.pooled["a"] * 2 + pb.pooled["c"]).sum().backward()

    weight = torch.from_numpy(table).requires_grad_(True)
    ref = {}
    for f, (values, lengths) in features.items():
        offsets = torch.from_numpy(np.r_[0, np.cumsum(lengths)[:-1]].astype(np.int64))
        ref[f] = F.embedding_bag(torch.from_numpy(values.astype(np.int64)), weight, offsets,
                                 mode="mean")
        torch.testing.assert_close(pb.pooled[f].detach(), ref[f].detach())
    (ref["a"] * 2 + ref["c"]).sum().backward()
    uniq = plan.groups[0].layout.ids.astype(np.int64)
    np.testing.assert_allclose(pb.row_grads()[0], weight.grad.numpy()[uniq], rtol=1e-5,
                               atol=1e-6)


def test_row_grads_are_leaves_and_zero_for_unreached_groups() -> None:
    plan = plan_batch({"a": (np.array([5, 5, 7], np.uint64), np.array([2, 1])),
                       "b": (np.array([1], np.uint64), np.array([1, 0]))}, groups=[["a"], ["b"]])
    rows = [np.ones((2, 2), np.float32), np.full((1, 2), 3.0, np.float16)]
    pb = pool_batch(plan, rows, mode={"a": "sum", "b": "mean"}, device="cpu")
    assert all(t.is_leaf and t.requires_grad for t in pb.rows)
    assert pb.rows[1].dtype == torch.float32
    pb.pooled["a"].sum().backward()
    grads = pb.row_grads()
    order = plan.groups[0].layout.ids.tolist()
    np.testing.assert_array_equal(grads[0][order.index(5)], [2.0, 2.0])  # id 5 used twice
    np.testing.assert_array_equal(grads[0][order.index(7)], [1.0, 1.0])
    np.testing.assert_array_equal(grads[1], np.zeros((1, 2), np.float32))
    rows[0][0, 0] = 42.0  # the leaf is a copy: changing the caller's array changes nothing
    assert pb.rows[0][0, 0].item() == 1.0


def test_batch_without_any_id_pools_to_zeros() -> None:
    plan = plan_batch({"f": (np.zeros(0, np.uint64), np.zeros(4, np.int32))}, num_shards=2)
    assert plan.unique["f"].size == 0
    pb = pool_batch(plan, [np.zeros((0, 3), np.float32)])
    assert pb.pooled["f"].shape == (4, 3)
    assert torch.count_nonzero(pb.pooled["f"]) == 0


@pytest.mark.parametrize("features, match", [
    ({}, "at least one sparse feature"),
    ({"f": (np.array([1, 2], np.uint64), np.array([1]))}, "add up to 1 but there are 2"),
    ({"f": (np.array([1], np.uint64), np.array([2, -1]))}, "lengths must be >= 0"),
    ({"f": (np.array([1.5]), np.array([1]))}, "values must be a 1-D integer array"),
    ({"f": (np.array([1], np.uint64), np.array([1.0]))}, "lengths must be a 1-D integer"),
    ({"f": np.array([1, 2])}, "expected \\(values, lengths\\)"),
    ({"f": (np.array([1], np.uint64), np.array([1])),
      "g": (np.array([1], np.uint64), np.array([1, 0]))}, "same batch size"),
    # the feature named is the one at fault, not its neighbour that takes up the slack
    ({"f": (np.array([1, 2, 3], np.uint64), np.array([1, 1])),
      "g": (np.array([4], np.uint64), np.array([2, -1]))}, "^g: lengths must be >= 0"),
    ({"f": (np.array([1], np.uint64), np.array([0, 2], np.int32)),
      "g": (np.array([4, 5, 6], np.uint64), np.array([1, 1], np.int32))},
     "^f: lengths add up to 2 but there are 1"),
])
def test_bad_batches_are_rejected(features: dict, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        plan_batch(features)


def test_bad_rows_and_modes_are_rejected() -> None:
    plan = plan_batch({"f": (np.array([3, 4], np.uint64), np.array([2]))})
    with pytest.raises(InvalidArgument, match="rows are needed for 1 groups, got 0"):
        pool_batch(plan, [])
    with pytest.raises(InvalidArgument, match="must be \\(2, dim\\)"):
        pool_batch(plan, [np.zeros((3, 4), np.float32)])
    with pytest.raises(InvalidArgument, match="must be floats"):
        pool_batch(plan, [np.zeros((2, 4), np.int64)])
    with pytest.raises(InvalidArgument, match="pooling modes"):
        pool_batch(plan, [np.zeros((2, 4), np.float32)], mode="max")
    with pytest.raises(InvalidArgument, match="no table for features \\['f'\\]"):
        plan_batch({"f": (np.array([3], np.uint64), np.array([1]))}, table_of={"g": "t"})
    with pytest.raises(InvalidArgument, match="pooling mode"):
        pool(torch.zeros(1, 2), torch.zeros(1, dtype=torch.long),
             torch.zeros(1, dtype=torch.long), "max")


def test_object_with_values_and_lengths_is_accepted() -> None:
    class Jagged:
        values = np.array([9, 9], np.uint64)
        lengths = np.array([1, 1], np.int32)

    plan = plan_batch({"f": Jagged()})
    np.testing.assert_array_equal(plan.unique["f"], [9])
    np.testing.assert_array_equal(plan.features["f"].inverse, [0, 0])
