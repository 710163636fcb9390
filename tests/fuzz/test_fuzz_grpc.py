"""Hypothesis against a real PS over gRPC: random msgpack, truncated messages, wrong dtypes and
shapes, huge declared lengths, bad or reused push sequence numbers. Each bad message must get
a clear error (an in-band error or
a status the error hierarchy names, never UNKNOWN or INTERNAL), the server must keep serving,
and every table must stay byte-identical."""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.common.codecs import ALLOWED_DTYPES, raw_array
from services.common.rpc import channel_options
from services.common.wire import PROTOCOL_VERSION, decode_message, encode_message
from services.ps.config import PSConfig
from services.ps.service import PSService
from tests.fuzz.cases import count_case
from tests.integration.ps.conftest import table_configs
from tests.integration.security.conftest import table_state

SCALE = float(os.environ.get("PERSIMMON_FUZZ_SCALE", "1"))
CLEAR = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
         grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED}
DIMS = {"user": 8, "item": 4}
CLIENT = 0xF022  # the client id of the valid pushes
SEQS = itertools.count(1)  # their sequence numbers (a fresh one per request drawn)
OLD_CLIENT, OLD_SEQ = 0xC0DE, 5000  # a client whose push 5000 the fixture applied


def fuzz(examples: int) -> settings:
    return settings(max_examples=int(examples * SCALE), deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


class Server:
    """A PS shard on its own event loop thread, and a blocking channel to it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.service = PSService(PSConfig(grpc_port=0, admin_port=0, tables=table_configs(),
                                          max_ids_per_request=10_000))
        self.run(self.service.start())
        self.channel = grpc.insecure_channel(self.service.address, options=channel_options())

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def send(self, method: str, raw: bytes) -> tuple[list[dict[str, Any]], grpc.StatusCode | None]:
        """Replies to one message on a fresh stream, and the status if the stream failed."""
        call = self.channel.stream_stream(f"/persimmon.PS/{method}")
        replies: list[dict[str, Any]] = []
        try:
            for reply in call(iter([raw]), timeout=30):
                replies.append(decode_message(reply))
        except grpc.RpcError as exc:
            return replies, exc.code()
        return replies, None

    def close(self) -> None:
        self.channel.close()
        self.run(self.service.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server()
    for table, dim in DIMS.items():  # some state to protect
        ids = np.arange(0, 3000, 3, dtype=np.uint64)
        grads = np.random.default_rng(0).normal(size=(ids.size, dim)).astype(np.float32)
        replies, code = srv.send("Push", encode_message(
            {"client": OLD_CLIENT, "seq": OLD_SEQ + DIMS[table], "tables": [table],
             "counts": [ids.size], "ids": raw_array(ids), "grads": [raw_array(grads)]}, rid=0))
        assert code is None and replies[0]["applied"] == ids.size
    yield srv
    srv.close()


def assert_refused_and_unchanged(server: Server, method: str, raw: bytes) -> None:
    count_case(f"gRPC {method} stream")
    before = table_state(server.service)
    replies, code = server.send(method, raw)
    assert code is None or code in CLEAR, (code, raw[:200])
    assert all("error" in r for r in replies), replies
    if code is None:
        assert len(replies) == 1 and replies[0]["error"]["code"] in {c.name for c in CLEAR}
    assert table_state(server.service) == before


# ---- random msgpack and random bytes ------------------------------------------------------

LEAVES = (st.none() | st.booleans() | st.integers(min_value=-2**63, max_value=2**64 - 1)
          | st.floats() | st.text(max_size=12) | st.binary(max_size=48))
VALUES = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=8) | st.sampled_from(
                          ["v", "rid", "table", "tables", "counts", "ids", "grads", "codec",
                           "lengths", "push", "lookup", "client", "seq"]), inner, max_size=6),
                      max_leaves=16)
STREAMS = ["Lookup", "Push", "PushThenLookup", "PooledLookup", "PooledPush"]
METHODS = st.sampled_from(STREAMS)


@given(method=METHODS, body=VALUES)
@fuzz(120)
def test_random_msgpack(server, method, body):
    assert_refused_and_unchanged(server, method, msgpack.packb(body, use_bin_type=True))


@given(method=METHODS, raw=st.binary(max_size=256))
@fuzz(60)
def test_random_bytes(server, method, raw):
    assert_refused_and_unchanged(server, method, raw)


# ---- valid messages made invalid on purpose -----------------------------------------------

def _array(arr: np.ndarray) -> dict[str, Any]:
    """A raw array map with its own bytes (so a test may cut or retype them)."""
    body = raw_array(arr).to_wire()
    body["data"] = bytes(body["data"])
    return body


@st.composite
def valid_request(draw: st.DrawFn) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """A method, a valid request body for it, and the (sub-)body holding ``ids`` to break."""
    method = draw(METHODS)
    table = draw(st.sampled_from(sorted(DIMS)))
    n = draw(st.integers(min_value=1, max_value=40))
    ids = np.array(draw(st.lists(st.integers(0, 2**64 - 1), min_size=n, max_size=n,
                                 unique=True)), dtype=np.uint64)
    codec = draw(st.sampled_from(["none", "fp16", "bf16"]))
    grads = np.ones((n, DIMS[table]), np.float32)
    lookup = {"tables": [table], "counts": [n], "ids": _array(ids), "codec": codec}
    push = {"client": CLIENT, "seq": next(SEQS), "tables": [table], "counts": [n],
            "ids": _array(ids), "grads": [_array(grads)]}
    if method == "Lookup":
        return method, lookup, lookup
    if method == "Push":
        return method, push, push
    if method == "PushThenLookup":
        body = {"push": push, "lookup": lookup}
        return method, body, body[draw(st.sampled_from(["push", "lookup"]))]
    lengths = np.array([n - n // 2, n // 2], dtype=np.int64)
    pooled: dict[str, Any] = {"table": table, "ids": _array(ids), "lengths": _array(lengths)}
    if method == "PooledLookup":
        pooled["codec"] = codec
    else:
        pooled["grads"] = _array(np.ones((2, DIMS[table]), np.float32))
        pooled.update(client=CLIENT, seq=next(SEQS))
    return method, pooled, pooled


def _retype(arr: dict[str, Any], dtype: str) -> None:
    """Same bytes, another dtype, a shape that matches the byte count where one exists."""
    itemsize = np.dtype(dtype).itemsize
    arr["dtype"] = dtype
    arr["shape"] = [len(arr["data"]) // itemsize]
    arr["data"] = arr["data"][: arr["shape"][0] * itemsize]


HUGE = [[2**40], [2**62, 4], [2**63 - 1], [2**64 - 1], [2**32, 2**32], [2**63, 2]]
NOT_UINT64 = sorted(ALLOWED_DTYPES - {"uint64"})
NOT_FLOAT = sorted(d for d in ALLOWED_DTYPES if not d.startswith("float"))


def break_array(draw: st.DrawFn, arr: dict[str, Any]) -> None:
    """Make one array of a request undecodable."""
    kind = draw(st.sampled_from(["truncate", "extend", "huge", "negative", "codec", "dtype"]))
    if kind == "truncate":
        arr["data"] = arr["data"][: draw(st.integers(0, len(arr["data"]) - 1))]
    elif kind == "extend":
        arr["data"] += draw(st.binary(min_size=1, max_size=16))
    elif kind == "huge":
        arr["shape"] = draw(st.sampled_from(HUGE))
    elif kind == "negative":
        arr["shape"] = [-draw(st.integers(1, 2**63))] + arr["shape"][1:]
    elif kind == "codec":
        arr["codec"] = draw(st.sampled_from(["fp16", "bf16", "int8", "onebit", "topk", "dct",
                                             "qsgd", "fp16+zstd", "none+lz4", "bogus"]) | VALUES)
        arr["meta"] = draw(VALUES)
    else:
        arr["dtype"] = draw(st.sampled_from(["object", "<f4", "complex64", "V8", "", "str"])
                            | VALUES)


def break_ids(draw: st.DrawFn, part: dict[str, Any]) -> None:
    """Decodable ids the shard must refuse: another dtype, or two dimensions."""
    if draw(st.booleans()):
        _retype(part["ids"], draw(st.sampled_from(NOT_UINT64)))
    else:
        n = part["ids"]["shape"][0]
        part["ids"]["shape"] = draw(st.sampled_from([[n, 1], [1, n]]))


def _grads_of(part: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
    """The gradient array of a (sub-)body and the rows it must have."""
    if "tables" in part:
        return part["grads"][0], [part["ids"]["shape"][0]]
    return part["grads"], [2]


def break_grads(draw: st.DrawFn, part: dict[str, Any]) -> None:
    """Decodable gradients of the wrong dim, row count or dtype kind."""
    grads, (rows,) = _grads_of(part)
    dim = grads["shape"][1]
    kind = draw(st.sampled_from(["dim", "rows", "dtype"]))
    if kind == "dim":
        new = _array(np.ones((rows, draw(st.integers(0, 12).filter(lambda d: d != dim))),
                             np.float32))
    elif kind == "rows":
        new = _array(np.ones((draw(st.integers(0, 50).filter(lambda m: m != rows)), dim),
                             np.float32))
    else:
        new = dict(grads)
        _retype(new, draw(st.sampled_from(NOT_FLOAT)))
    if "tables" in part:
        part["grads"] = [new]
    else:
        part["grads"] = new


def break_origin(draw: st.DrawFn, push: dict[str, Any]) -> None:
    """A push's (client, seq) missing, malformed, below the shard's window, or reused for
    other content."""
    kind = draw(st.sampled_from(["missing", "malformed", "too_old", "reused"]))
    if kind == "missing":
        del push[draw(st.sampled_from(["client", "seq"]))]
    elif kind == "malformed":
        bad = draw(st.sampled_from([-1, 2**63, 2**64 - 1, 1.0, "1", True, [1], b"\x01"])
                   | VALUES.filter(lambda v: type(v) is not int or not 0 <= v < 2**63))
        key = draw(st.sampled_from(["client", "seq"]))
        push[key] = 0 if key == "seq" and draw(st.booleans()) else bad
    elif kind == "too_old":  # more than a window (1024) below the fixture's push
        push.update(client=OLD_CLIENT, seq=draw(st.integers(1, OLD_SEQ - 1024)))
    else:  # the fixture's push numbers, with this request's other content
        push.update(client=OLD_CLIENT, seq=OLD_SEQ + draw(st.sampled_from(sorted(DIMS.values()))))


def break_message(draw: st.DrawFn, body: dict[str, Any], part: dict[str, Any]) -> None:
    """A bad table name or count, the protocol version, a reply codec, a v1 shape, or a bad
    push origin."""
    kind = draw(st.sampled_from(["table", "counts", "version", "codec", "v1_shape", "origin"]))
    push = body.get("push", body)
    if kind == "origin" and "seq" in push:
        break_origin(draw, push)
    elif kind == "table":
        bad = draw(st.sampled_from(["", "nope", "USER"]) | VALUES)
        if "tables" in part:
            part["tables"] = draw(st.sampled_from([[bad], bad, [], [part["tables"][0]] * 2]))
        else:
            part["table"] = bad
    elif kind == "counts" and "counts" in part:
        part["counts"] = draw(st.sampled_from([[part["counts"][0] + 1], [-1], [], "1"]) | VALUES)
    elif kind == "codec" and "grads" not in part:
        part["codec"] = draw(st.sampled_from(["bogus", "", "fp16+", "none+none", "qsgd:s=2"])
                             | VALUES)
    elif kind == "v1_shape":
        # a v1 body sent as v2 is still refused where "table" is not one of its fields
        multi = "tables" in body or "push" in body
        body["v"] = draw(st.sampled_from([1, PROTOCOL_VERSION] if multi else [1]))
        body["table"] = draw(st.sampled_from(sorted(DIMS)))
        body.pop("tables", None)
    else:
        body["v"] = draw(st.sampled_from([0, 1, 3, "2", None]))


@st.composite
def broken_request(draw: st.DrawFn) -> tuple[str, bytes]:
    """A valid request with one change that must make it invalid."""
    method, body, part = draw(valid_request())
    kind = draw(st.sampled_from(["array", "ids", "grads", "message", "cut"]))
    if kind == "array":
        name = draw(st.sampled_from([k for k in ("ids", "lengths", "grads") if k in part]))
        arr = part[name][0] if isinstance(part[name], list) else part[name]
        break_array(draw, arr)
    elif kind == "ids":
        break_ids(draw, part)
    elif kind == "grads" and "grads" in part:
        break_grads(draw, part)
    elif kind == "cut":
        raw = encode_message(body, rid=1)
        return method, raw[: draw(st.integers(0, len(raw) - 1))]
    else:
        break_message(draw, body, part)
    if "v" in body:
        return method, msgpack.packb({"rid": 1, **body}, use_bin_type=True)
    return method, encode_message(body, rid=1)


@given(request=broken_request())
@fuzz(250)
def test_broken_requests(server, request):
    assert_refused_and_unchanged(server, *request)


@given(body=VALUES)
@fuzz(40)
def test_unary_calls_with_bad_bodies(server, body):
    count_case("gRPC Tables+Stats unary")
    before = table_state(server.service)
    for method in ("Tables", "Stats"):
        try:
            server.channel.unary_unary(f"/persimmon.PS/{method}")(
                msgpack.packb(body, use_bin_type=True), timeout=30)
        except grpc.RpcError as exc:
            assert exc.code() in CLEAR, exc
    assert table_state(server.service) == before


def test_the_server_still_serves_after_the_fuzzing(server):
    ids = np.arange(0, 3000, 3, dtype=np.uint64)
    replies, code = server.send("Lookup", encode_message(
        {"tables": ["user"], "counts": [ids.size], "ids": raw_array(ids), "codec": "none"},
        rid=1))
    assert code is None and replies[0]["rows"]["shape"] == [ids.size, 8]
    assert server.service.shard.table("user").num_rows == ids.size


@given(request=valid_request())
@fuzz(20)
def test_the_unbroken_requests_are_served(server, request):
    """The requests the fuzzing breaks are valid before it does: each breaks for its change
    (run last: they change the tables)."""
    method, body, _ = request
    replies, code = server.send(method, encode_message(body, rid=3))
    assert code is None and len(replies) == 1 and "error" not in replies[0], replies
    assert replies[0]["rid"] == 3
