"""Every size a request names is bounded before anything is allocated (issue 45, finding 1).

Hostile frames sent as a peer would, on a real shard's gRPC stream: a step tag naming
millions of workers, a tiny push declaring a huge array, a frame of millions of empty
msgpack arrays. Each is refused with INVALID_ARGUMENT naming what is wrong, allocates
nothing near what it declares (peak traced memory, which counts numpy's buffers, while the
shard in this process serves it) and changes nothing.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import AsyncIterator

import grpc
import msgpack
import numpy as np
import pytest

from services.common.codecs import get_codec, raw_array
from services.common.wire import PROTOCOL_VERSION, decode_message, encode_message
from services.ps.service import PSService
from tests.integration.ps.conftest import digest, start_cluster

MIB = 1 << 20


@pytest.fixture
async def shard() -> AsyncIterator[PSService]:
    (service,) = await start_cluster(1)
    yield service
    await service.close()


async def answer(service: PSService, method: str, frame: bytes) -> tuple[str, str]:
    """Send one frame on a fresh stream: ("OK", "") for a reply, (code, message) for an
    in-band error or the stream's end."""
    async with grpc.aio.insecure_channel(service.address) as channel:
        call = channel.stream_stream(f"/persimmon.PS/{method}")()
        await call.write(frame)
        await call.done_writing()
        try:
            async for raw in call:
                reply = decode_message(raw)
                if "error" in reply:
                    return reply["error"]["code"], reply["error"]["message"]
                return "OK", ""
        except grpc.aio.AioRpcError as exc:
            return exc.code().name, exc.details() or ""
        return (await call.code()).name, await call.details() or ""


async def peak_while(coro) -> tuple[object, int]:
    """The result of ``coro`` and the peak of traced memory while it ran, in bytes."""
    tracemalloc.start()
    try:
        result = await coro
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def lookup_frame(tag: list[int]) -> bytes:
    return encode_message({"tables": ["user"], "counts": [2],
                           "ids": raw_array(np.array([1, 2], np.uint64)).to_wire(), "tag": tag},
                          rid=1)


@pytest.mark.parametrize("tag, names", [
    ([0, 1, 1_000_000], "max_workers"),  # past the shard's max_workers (4096)
    ([0, 1, 6_000_000], "workers <="),  # froze the shard 4.6 s building 6M entries
    ([0, 1, 2**62], "workers <="),  # larger: hung it, exhausted memory
    ([0, 2**60, 2], "step <"),
])
async def test_a_step_tag_naming_too_many_workers_is_refused(shard, tag, names):
    await answer(shard, "Lookup", lookup_frame([0, 1, 2]))  # an honest tagged lookup
    state = digest([shard])
    (code, message), peak = await peak_while(answer(shard, "Lookup", lookup_frame(tag)))
    assert code == "INVALID_ARGUMENT" and "tag" in message and names in message, message
    assert peak < 16 * MIB
    assert digest([shard]) == state
    assert shard.shard.stats("user").tables["user"].tagged_lookups == 1


def push_frame(ids: dict, grads: dict) -> bytes:
    return encode_message({"client": 7, "seq": 1, "tables": ["user"], "counts": ids["shape"],
                           "ids": ids, "grads": [grads]}, rid=1)


def topk_header(shape: list[int]) -> dict:
    """A top-k array of ``shape`` that keeps nothing: a few bytes whatever the shape."""
    return {"dtype": "float64", "shape": shape, "codec": "topk",
            "meta": {"mode": "sparse", "k": 0, "v": "fp16"}, "data": b""}


@pytest.mark.parametrize("ids_shape, grads_shape, names", [
    ([2**25], [2**25, 4], "ids"),  # ids declared, not carried: grads decoded first (1 GiB)
    ([1], [2**25, 4], "grads[0]"),  # rows that are not the ids' (refused before, too)
    ([1], [1, 2**24], "dim"),  # a dim that is not the table's: decoded first (128 MiB)
])
async def test_a_tiny_push_declaring_a_huge_array_is_refused_before_decoding(
        shard, ids_shape, grads_shape, names):
    ids = {"dtype": "uint64", "shape": ids_shape, "codec": "none", "meta": {},
           "data": np.array([1], np.uint64).tobytes()}
    frame = push_frame(ids, topk_header(grads_shape))
    assert len(frame) < 256
    state = digest([shard])
    (code, message), peak = await peak_while(answer(shard, "Push", frame))
    assert code == "INVALID_ARGUMENT" and names in message, message
    assert peak < 16 * MIB, f"a {len(frame)}-byte push made the shard allocate {peak} bytes"
    assert digest([shard]) == state


async def test_ids_must_travel_raw(shard):
    """Compressed ids could declare any count: they are refused, naming the field."""
    ids = np.array([1], np.uint64)
    frame = push_frame(get_codec("none+zstd").to_wire(ids).to_wire(),
                       raw_array(np.ones((1, 8), np.float32)).to_wire())
    code, message = await answer(shard, "Push", frame)
    assert code == "INVALID_ARGUMENT" and "ids" in message and "raw" in message, message


@pytest.mark.parametrize("junk", [
    [[]] * (4 * MIB),  # 4 MiB of empty arrays: 4M Python lists (~250 MB) once decoded
    [[[]] * 4096] * 1024,  # the same, nested under short arrays
    [[300] * 4096] * 512,  # ints, 3 bytes each on the wire, 28 bytes each in Python
], ids=["flat", "nested", "ints"])
async def test_a_frame_of_millions_of_objects_is_refused_before_msgpack_builds_it(shard, junk):
    frame = msgpack.packb({"v": PROTOCOL_VERSION, "rid": 1, "junk": junk})
    state = digest([shard])
    (code, message), peak = await peak_while(answer(shard, "Lookup", frame))
    assert code == "INVALID_ARGUMENT" and "msgpack objects" in message, message
    assert peak < 16 * MIB, f"a {len(frame)}-byte frame became {peak} bytes of heap"
    assert digest([shard]) == state


async def test_honest_requests_still_pass(shard):
    """The bounds refuse nothing a client sends: a push of many tables' ids, then lookups."""
    ids = np.arange(50_000, dtype=np.uint64)
    grads = get_codec("topk", keep=0.01).to_wire(np.ones((ids.size, 8), np.float32))
    code, _ = await answer(shard, "Push", encode_message(
        {"client": 7, "seq": 1, "tables": ["user"], "counts": [ids.size],
         "ids": raw_array(ids).to_wire(), "grads": [grads.to_wire()], "tag": [0, 1, 4096]},
        rid=1))
    assert code == "OK"
    assert shard.shard.table("user").num_rows == ids.size
