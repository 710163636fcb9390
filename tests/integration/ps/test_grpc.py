"""The PS over real gRPC: round trips, routing, codecs, and bad input that changes nothing."""

from __future__ import annotations

import asyncio
import itertools

import grpc
import msgpack
import numpy as np
import pytest

from clients.ps_client import PSClient
from services.common.codecs import raw_array
from services.common.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ProtocolMismatch,
    Unavailable,
    WrongShard,
)
from services.common.messages import (
    LookupReply,
    LookupRequest,
    PushReply,
    PushRequest,
    PushThenLookupReply,
)
from services.common.sharding import ShardedIds, shard_of
from services.common.wire import PROTOCOL_VERSION, encode_message
from services.ps.config import PSConfig
from services.ps.service import PSService
from tests.conftest import free_port
from tests.integration.ps.conftest import digest, shard_stream, table_configs


class Raw:
    """A hand-made message body, sent as it is: the typed messages would refuse it first."""

    def __init__(self, body):
        self.body = body

    def to_wire(self):
        return self.body


_SEQS = itertools.count(1)


def origin() -> dict:
    """The (client, seq) every push body carries; a fresh number each time."""
    return {"client": 99, "seq": next(_SEQS)}


def addresses(cluster):
    return [s.address for s in cluster]


async def test_lookup_returns_initial_rows_in_request_order(cluster):
    ids = np.array([5, 17, 5, 1999, 3, 17], dtype=np.uint64)
    async with PSClient(addresses(cluster)) as ps:
        rows = await ps.lookup("user", ids)
    assert rows.shape == (6, 8)
    np.testing.assert_array_equal(rows[0], rows[2])
    for i, row_id in enumerate(ids):
        owner = cluster[int(shard_of(row_id, 2))].shard.table("user")
        np.testing.assert_array_equal(rows[i], owner.initial_rows(np.array([row_id], np.uint64))[0])


async def test_read_only_lookups_create_no_rows_and_see_the_pushes(cluster):
    ids = np.arange(40, dtype=np.uint64)
    async with PSClient(addresses(cluster)) as ps:
        peeked = await ps.lookup("item", ids, read_only=True)
        assert sum(s.shard.table("item").num_rows for s in cluster) == 0  # nothing created
        np.testing.assert_array_equal(peeked, await ps.lookup("item", ids))  # initial rows
        assert sum(s.shard.table("item").num_rows for s in cluster) == 40
        await ps.push("item", ids[:10], np.ones((10, 4), np.float32))
        after = await ps.lookup("item", np.r_[ids, ids + 1000], read_only=True)
    np.testing.assert_allclose(after[:10], peeked[:10] - 0.5)  # sgd lr 0.5: the push is seen
    np.testing.assert_array_equal(after[10:40], peeked[10:])
    assert sum(s.shard.table("item").num_rows for s in cluster) == 40  # ids + 1000: none made


async def test_push_applies_optimizer_on_the_owning_shard(cluster):
    ids = np.arange(100, dtype=np.uint64)
    grads = np.ones((100, 4), dtype=np.float32)
    async with PSClient(addresses(cluster)) as ps:
        before = await ps.lookup("item", ids)
        ack = await ps.push("item", np.r_[ids, ids[:10]], np.r_[grads, grads[:10]])
        after = await ps.lookup("item", ids)
    assert ack.applied == 100 and ack.dropped_nonfinite == 0
    expected = before - 0.5 * np.r_[np.full(10, 2.0), np.ones(90)][:, None]  # duplicates summed
    np.testing.assert_allclose(after, expected, rtol=1e-6)
    counts = [s.shard.table("item").num_rows for s in cluster]
    assert sum(counts) == 100 and min(counts) > 0


async def test_fp16_and_bf16_rows_within_tolerance(cluster):
    ids = np.arange(50, dtype=np.uint64)
    async with PSClient(addresses(cluster)) as exact:
        ref = await exact.lookup("user", ids)
    for codec, rtol in (("fp16", 2**-10), ("bf16", 2**-7)):
        async with PSClient(addresses(cluster), rows_codec=codec, grads_codec=codec) as ps:
            rows = await ps.lookup("user", ids)
            np.testing.assert_allclose(rows, ref, rtol=rtol, atol=1e-6)
            await ps.push("user", ids, np.zeros((50, 8), np.float32))
            assert ps.wire_bytes()["lookup_in"] < 50 * 8 * 4 + 400


async def test_many_requests_in_flight_on_one_stream(cluster):
    import asyncio

    async with PSClient(addresses(cluster)) as ps:
        batches = [np.arange(i * 10, i * 10 + 10, dtype=np.uint64) for i in range(40)]
        results = await asyncio.gather(*(ps.lookup("user", b) for b in batches))
        single = await ps.lookup("user", np.concatenate(batches))
    np.testing.assert_array_equal(np.concatenate(results), single)


async def test_nan_gradients_are_dropped_and_counted(cluster):
    ids = np.arange(20, dtype=np.uint64)
    grads = np.ones((20, 8), np.float32)
    grads[3, 2] = np.nan
    grads[7, 0] = np.inf
    async with PSClient(addresses(cluster)) as ps:
        before = await ps.lookup("user", ids)
        ack = await ps.push("user", ids, grads)
        after = await ps.lookup("user", ids)
    assert ack.dropped_nonfinite == 2 and ack.applied == 18
    np.testing.assert_array_equal(after[[3, 7]], before[[3, 7]])
    assert not np.array_equal(after[0], before[0])


@pytest.mark.parametrize("case", ["unknown_table", "wrong_dim", "length_mismatch",
                                  "float_ids", "missing_table", "bad_codec", "v1_single_table",
                                  "v1_push_with_lookup", "string_count", "read_only_int"])
async def test_bad_requests_get_clear_errors_and_change_nothing(cluster, case):
    async with PSClient(addresses(cluster)) as ps:
        await ps.lookup("user", np.arange(30, dtype=np.uint64))
        state = digest(cluster)
        ids = np.arange(10, dtype=np.uint64)
        mine = ids[shard_of(ids, 2) == 0]
        n = [mine.size]
        grads = [raw_array(np.ones((mine.size, 8), np.float32))]
        bodies = {
            "unknown_table": ("push", {**origin(), "tables": ["nope"], "counts": n, "ids": raw_array(mine),
                                       "grads": grads}, "'nope'"),
            "wrong_dim": ("push", {**origin(), "tables": ["user"], "counts": n, "ids": raw_array(mine),
                                   "grads": [raw_array(np.ones((mine.size, 3), np.float32))]},
                          "dim"),
            "length_mismatch": ("push", {**origin(), "tables": ["user"], "counts": n, "ids": raw_array(mine),
                                         "grads": [raw_array(np.ones((mine.size + 1, 8),
                                                                     np.float32))]}, "rows|must be"),
            "float_ids": ("lookup", {"tables": ["user"], "counts": n,
                                     "ids": raw_array(mine.astype(np.float64))}, "uint64"),
            "missing_table": ("lookup", {"counts": n, "ids": raw_array(mine)}, "'tables'"),
            "bad_codec": ("lookup", {"tables": ["user"], "counts": n, "ids": raw_array(mine),
                                     "codec": "zip9"}, "zip9"),
            "v1_single_table": ("lookup", {"table": "user", "ids": raw_array(mine)},
                                "unknown fields"),
            "v1_push_with_lookup": ("push", {**origin(), "tables": ["user"], "counts": n,
                                             "ids": raw_array(mine), "grads": grads,
                                             "lookup": {"tables": ["user"], "counts": n,
                                                        "ids": raw_array(mine)}},
                                    "PushThenLookup"),
            "string_count": ("lookup", {"tables": ["user"], "counts": [str(mine.size)],
                                        "ids": raw_array(mine)}, "counts\\[0\\]: Expected `int`"),
            "read_only_int": ("lookup", {"tables": ["user"], "counts": n, "ids": raw_array(mine),
                                         "read_only": 1}, "read_only: Expected `bool"),
        }
    method, body, match = bodies[case]
    expected = NotFound if case == "unknown_table" else InvalidArgument
    good = {"lookup": (LookupRequest(tables=["user"], counts=n, ids=raw_array(mine)),
                       LookupReply),
            "push": (PushRequest(**origin(), tables=["user"], counts=n, ids=raw_array(mine),
                                 grads=grads), PushReply)}[method]
    async with shard_stream(cluster[0].address, method.capitalize()) as stream:
        with pytest.raises(expected, match=match) as info:
            await stream.request(Raw(body), LookupReply)
        assert info.value.message
        assert digest(cluster) == state
        assert isinstance(await stream.request(*good), good[1])  # the stream survives it


async def test_ids_of_another_shard_are_rejected(cluster):
    ids = np.arange(64, dtype=np.uint64)
    foreign = ids[shard_of(ids, 2) == 1]
    state = digest(cluster)
    async with shard_stream(cluster[0].address, "Push") as stream:
        with pytest.raises(WrongShard, match="do not belong to shard 0"):
            await stream.request(Raw({
                **origin(), "tables": ["user"], "counts": [foreign.size], "ids": raw_array(foreign),
                "grads": [raw_array(np.ones((foreign.size, 8), np.float32))]}), PushReply)
    assert digest(cluster) == state


async def raw_stream_call(address: str, method: str, payload: bytes):
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.stream_stream(f"/persimmon.PS/{method}")()
        await call.write(payload)
        await call.done_writing()
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details()
        return await call.code(), await call.details()


async def test_malformed_msgpack_is_invalid_argument(cluster):
    state = digest(cluster)
    code, details = await raw_stream_call(cluster[0].address, "Push", b"\xc1\xff\x00garbage")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "msgpack" in details
    code, details = await raw_stream_call(cluster[0].address, "Lookup", msgpack.packb([1, 2]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "map" in details
    assert digest(cluster) == state


async def test_protocol_version_mismatch_is_failed_precondition(cluster):
    assert PROTOCOL_VERSION == 2
    state = digest(cluster)
    payload = msgpack.packb({"v": 999, "rid": 1, "table": "user"})
    code, details = await raw_stream_call(cluster[0].address, "Lookup", payload)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "999" in details
    assert issubclass(ProtocolMismatch, FailedPrecondition)
    ids = np.arange(20, dtype=np.uint64)[shard_of(np.arange(20, dtype=np.uint64), 2) == 0]
    v1_push = msgpack.packb({"v": 1, "rid": 1, "table": "user", "ids": raw_array(ids).to_wire(),
                             "grads": raw_array(np.ones((ids.size, 8), np.float32)).to_wire()},
                            use_bin_type=True)
    code, details = await raw_stream_call(cluster[0].address, "Push", v1_push)
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "protocol version 1" in details and "speaks version 2" in details
    code, details = await raw_stream_call(cluster[0].address, "Push",
                                          msgpack.packb({"rid": 1, "tables": ["user"]}))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "no protocol version" in details
    async with grpc.aio.insecure_channel(cluster[0].address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await channel.unary_unary("/persimmon.PS/Tables")(msgpack.packb({"v": 1}))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert digest(cluster) == state  # nothing applied


async def test_truncated_array_buffer_is_invalid_argument(cluster):
    state = digest(cluster)
    grads = raw_array(np.ones((1, 8), np.float32)).to_wire()
    grads["data"] = bytes(grads["data"])[:-4]
    body = {**origin(), "tables": ["user"], "counts": [1],
            "ids": raw_array(np.array([2], np.uint64)), "grads": [grads]}
    async with shard_stream(cluster[int(shard_of(2, 2))].address, "Push") as stream:
        with pytest.raises(InvalidArgument, match="needs 32 bytes"):
            await stream.request(Raw(body), PushReply)
    assert digest(cluster) == state


async def test_oversized_message_is_invalid_argument(tmp_path):
    from tests.integration.ps.conftest import start_cluster

    services = await start_cluster(1, max_message_bytes=4096)
    try:
        state = digest(services)
        big = encode_message({"tables": ["user"], "counts": [700],
                              "ids": raw_array(np.arange(700, dtype=np.uint64))}, rid=1)
        code, details = await raw_stream_call(services[0].address, "Lookup", big)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "exceeds the limit" in details
        # far past the limit the transport itself refuses the message
        huge = encode_message({"tables": ["user"], "counts": [5000],
                               "ids": raw_array(np.arange(5000, dtype=np.uint64))}, rid=1)
        code, _ = await raw_stream_call(services[0].address, "Lookup", huge)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert digest(services) == state
    finally:
        await services[0].close()


async def test_too_many_ids_per_request_is_rejected():
    from tests.integration.ps.conftest import start_cluster

    services = await start_cluster(1, max_ids_per_request=100)
    try:
        async with PSClient([services[0].address]) as ps:
            with pytest.raises(InvalidArgument, match="exceed the limit of 100"):
                await ps.lookup("user", np.arange(101, dtype=np.uint64))
            assert services[0].shard.table("user").num_rows == 0
    finally:
        await services[0].close()


async def test_client_checks_shard_order(cluster):
    with pytest.raises(FailedPrecondition, match="shard order"):
        await PSClient(list(reversed(addresses(cluster)))).connect()


async def test_a_client_connects_to_shards_that_come_up_within_its_retry_s():
    """Connecting retries each shard's Tables call on a fresh channel until ``retry_s``:
    shards that start listening after the client began to connect are found (one of them
    later than the other); without ``retry_s`` the connect fails at once."""
    ports = [free_port(), free_port()]
    listed = [f"127.0.0.1:{port}" for port in ports]
    with pytest.raises(Unavailable):
        await PSClient(listed, timeout=2).connect()
    client = PSClient(listed, timeout=2, retry_s=30)
    connecting = asyncio.create_task(client.connect())
    services = []
    try:
        for port in ports:
            await asyncio.sleep(0.5)
            assert not connecting.done()
            services.append(PSService(PSConfig(
                shard_id=len(services), num_shards=2, grpc_port=port, admin_port=0,
                tables=table_configs())))
            await services[-1].start()
        await asyncio.wait_for(connecting, 20)
        rows = await client.lookup("item", np.arange(6, dtype=np.uint64))
        assert rows.shape == (6, 4) and client.epochs == [1, 1]
    finally:
        connecting.cancel()
        await client.close()
        for service in services:
            await service.close()


async def test_unary_tables_and_stats(cluster):
    async with PSClient(addresses(cluster)) as ps:
        await ps.lookup("item", np.arange(10, dtype=np.uint64))
        tables = await ps.tables()
        stats = await ps.stats("item")
    assert {(t.name, t.dim, t.optimizer.kind) for t in tables} == {("user", 8, "adagrad"),
                                                                    ("item", 4, "sgd")}
    assert [s.shard_id for s in stats] == [0, 1] and all(s.epoch == 1 for s in stats)
    assert sum(s.tables["item"].rows for s in stats) == 10 and set(stats[0].tables) == {"item"}


async def test_multi_table_messages_equal_one_table_at_a_time(cluster):
    ids = {"user": np.arange(0, 40, dtype=np.uint64), "item": np.arange(7, 30, dtype=np.uint64)}
    async with PSClient(addresses(cluster)) as ps:
        together = await ps.lookup_tables(ids)
        for table, table_ids in ids.items():
            np.testing.assert_array_equal(together[table], await ps.lookup(table, table_ids))
        grads = {t: np.full((i.size, together[t].shape[1]), 0.5, np.float32)
                 for t, i in ids.items()}
        ack = await ps.push_tables(ids, grads)
        assert ack.applied == 40 + 23
        after = await ps.lookup_tables(ids)
    for table in ids:  # every part applied, on its own table (SGD lr 0.5 on item: see above)
        assert not np.array_equal(after[table], together[table])


async def test_multi_table_message_is_one_request_per_shard_in_layout_order(cluster):
    ids = {"user": np.arange(0, 40, dtype=np.uint64), "item": np.arange(7, 30, dtype=np.uint64)}
    layout, where = ShardedIds.of_tables({"user": ids["user"]}, 2)
    async with PSClient(addresses(cluster)) as ps:
        rows = await ps.lookup_sharded(layout)
        np.testing.assert_array_equal(rows[where["user"]], await ps.lookup("user", ids["user"]))
        sent = ps.wire_bytes()["lookup_out"]
        await ps.lookup_sharded(layout)
        assert ps.wire_bytes()["lookup_out"] > sent
        ack = await ps.push_sharded(layout, np.ones((layout.ids.size, 8), np.float32))
        with pytest.raises(InvalidArgument, match="grads must be"):
            await ps.push_sharded(layout, np.ones((3, 8), np.float32))
    assert ack.applied == 40


_MINE = np.arange(20, dtype=np.uint64)[shard_of(np.arange(20, dtype=np.uint64), 2) == 0]


def _push_body(case: str) -> dict:
    n = _MINE.size
    both = np.r_[_MINE, _MINE]
    body = {**origin(), "tables": ["user"], "counts": [n], "ids": raw_array(_MINE),
            "grads": [raw_array(np.ones((n, 8), np.float32))]}
    changes = {
        "two_dims": {"tables": ["user", "item"], "counts": [n, n], "ids": raw_array(both),
                     "grads": [raw_array(np.ones((n, 8), np.float32)),
                               raw_array(np.ones((n, 4), np.float32))]},
        "same_table_twice": {"tables": ["user", "user"], "counts": [n, n], "ids": raw_array(both),
                             "grads": [raw_array(np.ones((2 * n, 8), np.float32))]},
        "no_tables": {"tables": []},
        "counts_do_not_add_up": {"counts": [n + 1]},
        "negative_count": {"counts": [-1]},
        "grads_per_table_short": {"grads": []},
        "grads_wrong_rows": {"grads": [raw_array(np.ones((n + 1, 8), np.float32))]},
        "grads_not_a_list": {"grads": raw_array(np.ones((n, 8), np.float32))},
    }
    return {**body, **changes[case]}


@pytest.mark.parametrize("case", ["two_dims", "same_table_twice", "no_tables",
                                  "counts_do_not_add_up", "negative_count",
                                  "grads_per_table_short", "grads_wrong_rows",
                                  "grads_not_a_list"])
async def test_multi_table_push_with_a_bad_part_changes_nothing(cluster, case):
    async with PSClient(addresses(cluster)) as ps:
        await ps.lookup_tables({"user": np.arange(30, dtype=np.uint64)})
    state = digest(cluster)
    async with shard_stream(cluster[0].address, "Push") as push, \
            shard_stream(cluster[0].address, "Lookup") as lookup:
        with pytest.raises(InvalidArgument) as info:
            await push.request(Raw(_push_body(case)), PushReply)
        assert info.value.message
        assert digest(cluster) == state  # no part was applied
        with pytest.raises(InvalidArgument):
            await lookup.request(Raw({"tables": ["user"], "counts": [1], "ids": 5}), LookupReply)
        rows = await lookup.request(LookupRequest(tables=["user"], counts=[_MINE.size],
                                                  ids=raw_array(_MINE)), LookupReply)
        assert list(rows.rows.shape) == [_MINE.size, 8]  # the stream goes on


async def test_push_then_lookup_rows_include_the_push(cluster):
    """One message per shard pushes one layout and looks another up after it; the rows equal
    those a separate push then lookup give."""
    pushed, _ = ShardedIds.of_tables({"user": np.arange(100, 140, dtype=np.uint64)}, 2)
    asked, where = ShardedIds.of_tables({"user": np.arange(120, 170, dtype=np.uint64)}, 2)
    grads = np.full((pushed.ids.size, 8), 0.25, np.float32)
    async with PSClient(addresses(cluster)) as ps:
        before = await ps.lookup_sharded(asked)
        sent = ps.wire_bytes()
        ack, rows = await ps.push_then_lookup(pushed, grads, asked)
        assert ps.wire_bytes()["lookup_out"] == sent["lookup_out"]  # the lookups rode the
        assert ps.wire_bytes()["push_out"] > sent["push_out"]  # pushes: PushThenLookup
        after = await ps.lookup_sharded(asked)
        only_lookup, _ = ShardedIds.of_tables({"user": np.array([5000], np.uint64)}, 2)
        empty = ShardedIds.of_tables({"user": np.empty(0, np.uint64)}, 2)[0]
        ack2, rows2 = await ps.push_then_lookup(empty, np.zeros((0, 8), np.float32), only_lookup)
    assert ack.applied == 40 and ack2.applied == 0 and rows2.shape == (1, 8)
    np.testing.assert_array_equal(rows, after)  # the lookup saw the push
    changed = np.isin(asked.ids, pushed.ids)
    assert not np.allclose(rows[changed], before[changed])
    np.testing.assert_array_equal(rows[~changed], before[~changed])
    assert rows[where["user"]].shape == (50, 8)


async def test_push_with_a_bad_lookup_part_applies_nothing(cluster):
    async with PSClient(addresses(cluster)) as ps:
        await ps.lookup_tables({"user": np.arange(30, dtype=np.uint64)})
    state = digest(cluster)
    async with shard_stream(cluster[0].address, "PushThenLookup") as stream:
        for lookup in ({"tables": ["nope"], "counts": [_MINE.size], "ids": raw_array(_MINE)},
                       {"tables": ["user"], "counts": [_MINE.size + 1], "ids": raw_array(_MINE)},
                       ["not", "a", "map"]):
            with pytest.raises((InvalidArgument, NotFound)):
                await stream.request(Raw({
                    "push": _push_body("two_dims") | {"tables": ["user"], "counts": [_MINE.size],
                                                      "ids": raw_array(_MINE),
                                                      "grads": [raw_array(np.ones(
                                                          (_MINE.size, 8), np.float32))]},
                    "lookup": lookup}), PushThenLookupReply)
        assert digest(cluster) == state  # the push was not applied either


async def test_state_lookup_reads_each_rows_exact_optimizer_state(cluster):
    """A replica's seed: the rows exactly (even with a lossy rows codec) and each row's
    Adagrad accumulator as its shard holds it, in layout order; ids never pushed read the
    initial accumulator. A PushThenLookup cannot ask for it (it would be dropped)."""
    ids = np.arange(60, dtype=np.uint64)
    pushed = ids[::3]
    async with PSClient(addresses(cluster), rows_codec="fp16") as ps:
        await ps.push("user", pushed, np.full((pushed.size, 8), 0.5, np.float32))
        layout, where = ShardedIds.of_tables({"user": ids}, 2)
        rows, state = await ps.lookup_state_sharded(layout)
    async with shard_stream(cluster[0].address, "PushThenLookup") as stream:
        with pytest.raises(InvalidArgument, match="optimizer state up with Lookup"):
            await stream.request(Raw({
                "push": _push_body("two_dims") | {"tables": ["user"], "counts": [0],
                                                  "ids": raw_array(np.empty(0, np.uint64)),
                                                  "grads": [raw_array(np.ones((0, 8),
                                                                              np.float32))]},
                "lookup": {"tables": ["user"], "counts": [_MINE.size], "ids": raw_array(_MINE),
                           "with_state": True}}), PushThenLookupReply)
    assert set(state) == {"accum"} and state["accum"].shape == (60, 8)
    for k, shard in enumerate(cluster):
        table = shard.shard.table("user")
        mine = layout.ids[layout.bounds[k]:layout.bounds[k + 1]]
        lo, hi = layout.bounds[k], layout.bounds[k + 1]
        np.testing.assert_array_equal(rows[lo:hi], table.peek(mine)[0])  # exact, not fp16
        np.testing.assert_array_equal(state["accum"][lo:hi], table.state_of(mine)["accum"])
    accum = state["accum"][where["user"]]
    was_pushed = np.isin(ids, pushed)
    np.testing.assert_allclose(accum[was_pushed], 0.25, rtol=1e-6)  # 0 + 0.5**2
    assert (accum[~was_pushed] == 0).all()  # the table's initial accumulator
