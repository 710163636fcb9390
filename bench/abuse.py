"""``python -m bench abuse``: every attack on a live PS shard answered fast, nothing changed.

One shard process (token set, write-ahead log on, its address space capped at ``--max-gb``
so a runaway allocation fails rather than swapping the machine) holds a table per optimizer
and storage type, with probe rows pushed to before the attacks. Each attack sends one hostile
request, or a short hostile sequence, the way a peer would: crafted msgpack frames on the
real gRPC stream, hostile bodies on the real admin port. For each it prints:

- ``answer``: the gRPC code or HTTP status it got (``timeout``: none in ``--timeout-s``;
  ``died``: the shard exited), and ``answer_ms``, how long that took;
- ``stall_ms``: the longest time a concurrent ``/healthz`` prober (a request every 2 ms on its
  own connection) waited for the shard's event loop while the attack ran;
- ``rss_mb``: the shard's peak resident memory during the attack above its resident memory
  before it (the peak is reset before each attack through ``/proc/PID/clear_refs``);
- ``rows_changed``: probe rows whose values or optimizer state differ (bit for bit) after
  the attack (``refused``: the answer applied nothing, an error or a push acked with 0 rows),
  and ``nonfinite_rows``: probe rows left NaN or infinite.

A shard that timed out or died is restarted before the next attack. Figures:
``abuse_max_stall_ms``, ``abuse_max_rss_mb``, ``abuse_rows_changed`` (summed over the refused
requests), ``abuse_rows_nonfinite``, ``abuse_max_answer_ms``, ``abuse_cases``.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import select
import socket
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import msgpack
import numpy as np
from rich.console import Console
from rich.table import Table

from bench import main_of
from services.common.codecs import get_codec
from services.common.messages import Envelope, LookupRequest, PushRequest
from services.common.rpc import channel_options
from services.common.wire import PROTOCOL_VERSION, decode_message, encode_message

__all__ = ["ATTACKS", "register_bench", "run"]

console = Console(stderr=True)
TOKEN = "abuse-bench-token"
SERVICE = "persimmon.PS"
DIM = 4
PROBE_IDS = np.arange(1, 65, dtype=np.uint64)
# name -> (dtype, optimizer): one table per way a finite gradient can make a row non-finite
TABLES: dict[str, tuple[str, dict[str, Any]]] = {
    "sgd": ("float32", {"kind": "sgd", "lr": 4.0}),
    "sgd16": ("float16", {"kind": "sgd", "lr": 1.0}),
    "adagrad": ("float32", {"kind": "adagrad", "lr": 0.1}),
    "ftrl": ("float32", {"kind": "ftrl", "lr": 0.1}),
    "dedup": ("float32", {"kind": "sgd", "lr": 1.0}),
}
SCRATCH = "scratch"  # rows the attacks may legitimately change (not compared)


# ---- the shard and what is watched ---------------------------------------------------------

class ShardProcess:
    """One ``services.ps`` process under ``work`` with the bench's tables."""

    def __init__(self, work: Path, max_gb: float) -> None:
        import yaml

        from services.local.processes import start_service

        tables = [{"name": name, "dim": DIM, "dtype": dtype, "initializer": "zeros",
                   "optimizer": optimizer} for name, (dtype, optimizer) in TABLES.items()]
        tables.append({"name": SCRATCH, "dim": DIM, "initializer": "zeros",
                       "optimizer": {"kind": "sgd", "lr": 1.0}})
        config = work / "ps.yaml"
        config.write_text(yaml.safe_dump({"tables": tables}))
        command = ["prlimit", f"--as={int(max_gb * 2**30)}", sys.executable, "-m",
                   "services.ps", "--log-level", "ERROR", "--config", str(config),
                   "--checkpoint-dir", str(work / "checkpoints"),
                   "--wal-dir", str(work / f"wal-{time.monotonic_ns()}")]
        os.environ["PERSIMMON_TOKEN"] = TOKEN
        try:
            self.proc, grpc_port, admin_port = start_service(
                command, str(work / "ps.ready"), timeout=120)
        finally:
            del os.environ["PERSIMMON_TOKEN"]
        self.address = f"127.0.0.1:{grpc_port}"
        self.admin_port = admin_port

    def alive(self) -> bool:
        return self.proc.poll() is None

    def memory_kb(self) -> tuple[int, int]:
        """(resident, peak resident) in KiB."""
        fields = dict(line.split(":", 1) for line in
                      Path(f"/proc/{self.proc.pid}/status").read_text().splitlines())
        return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])

    def reset_peak(self) -> None:
        Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")

    def stop(self) -> None:
        from services.local.processes import stop_processes

        stop_processes([self.proc])


class Prober(threading.Thread):
    """``GET /healthz`` every 2 ms; the longest wait for an answer since :meth:`mark`."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.longest = 0.0
        self._since = time.perf_counter()
        self._stop_event = threading.Event()

    def mark(self) -> None:
        self.longest, self._since = 0.0, time.perf_counter()

    def stall_ms(self) -> float:
        """Longest wait since :meth:`mark`, counting a probe still unanswered."""
        return 1e3 * max(self.longest, time.perf_counter() - self._since)

    def run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        while not self._stop_event.is_set():
            try:
                conn.request("GET", "/healthz")
                conn.getresponse().read()
            except OSError:
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
            now = time.perf_counter()
            self.longest = max(self.longest, now - self._since)
            self._since = now
            time.sleep(0.002)

    def stop(self) -> None:
        self._stop_event.set()


# ---- talking to the shard as a peer would --------------------------------------------------

def _metadata() -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKEN}"),)


async def send_frame(address: str, method: str, frame: bytes, timeout: float) -> str:
    """One raw frame on stream ``method``: the reply's error code, ``OK``, or the call's
    status code."""
    async with grpc.aio.insecure_channel(address, options=channel_options()) as channel:
        call = channel.stream_stream(f"/{SERVICE}/{method}")(metadata=_metadata(),
                                                              timeout=timeout)
        try:
            await call.write(frame)
            await call.done_writing()
            raw = await call.read()
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
        if raw is grpc.aio.EOF:
            return (await call.code()).name
        failure = Envelope.of(raw).exception()
        if failure is not None:
            return failure.grpc_code.name
        return "OK" + _applied(decode_message(raw))


def _applied(body: dict[str, Any]) -> str:
    """`` applied=N`` of a push's reply (a push answered OK may still refuse rows)."""
    push = body.get("push", body) if isinstance(body.get("push", body), dict) else body
    if "applied" in push:
        return f" applied={push['applied']} dropped={push.get('dropped', 0)}"
    return ""


def lookup_frame(table: str, ids: np.ndarray, **fields: Any) -> bytes:
    req = LookupRequest(tables=[table], counts=[ids.size], ids=get_codec("none").to_wire(ids))
    return encode_message({**req.to_wire(), **fields})


def push_frame(table: str, ids: np.ndarray, grads: np.ndarray, *, client: int = 1,
               seq: int = 1) -> bytes:
    raw = get_codec("none")
    req = PushRequest(client=client, seq=seq, tables=[table], counts=[ids.size],
                      ids=raw.to_wire(ids), grads=[raw.to_wire(grads)])
    return encode_message(req.to_wire())


async def snapshot(address: str) -> dict[str, bytes]:
    """Every compared table's probe rows and their optimizer state, read only, as bytes."""
    out = {}
    for table in TABLES:
        frame = lookup_frame(table, PROBE_IDS, read_only=True, with_state=True)
        async with grpc.aio.insecure_channel(address, options=channel_options()) as channel:
            call = channel.stream_stream(f"/{SERVICE}/Lookup")(metadata=_metadata(), timeout=60)
            await call.write(frame)
            await call.done_writing()
            body = decode_message(await call.read())
        if "rows" not in body:
            out[table] = b"error"
            continue
        raw = get_codec("none")
        arrays = [raw.from_wire(body["rows"])] + [
            raw.from_wire(state).reshape(PROBE_IDS.size, -1)
            for _, state in sorted((body.get("state") or {}).items())]
        out[table] = np.concatenate([a.view(np.uint8).reshape(PROBE_IDS.size, -1)
                                     for a in arrays], axis=1).tobytes()
    return out


def admin(port: int, method: str, path: str, *, body: bytes | None = None,
          chunks: int = 0, token: bool = True, timeout: float = 30.0) -> str:
    """One admin request: its HTTP status. ``chunks`` MiB sent chunked instead of ``body``."""
    if chunks:
        return _chunked(port, method, path, chunks, timeout)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    headers = {"content-type": "application/json"}
    if token:
        headers["authorization"] = f"Bearer {TOKEN}"
    try:
        conn.request(method, path, body=body, headers=headers)
        return str(conn.getresponse().status)
    except TimeoutError:
        return "timeout"
    finally:
        conn.close()


def _chunked(port: int, method: str, path: str, mib: int, timeout: float) -> str:
    """A body of ``mib`` 1 MiB chunks, sent while the server has not answered: the status
    it answered with (``closed``: it closed the connection with no answer)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(f"{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                     f"authorization: Bearer {TOKEN}\r\ncontent-type: application/json\r\n"
                     "transfer-encoding: chunked\r\n\r\n".encode())
        chunk = b"100000\r\n" + b" " * 2**20 + b"\r\n"
        head = b""
        try:
            for k in range(mib):  # near the cap (16 MiB) a moment is given to answer
                if select.select([sock], [], [], 0.005 if k >= 15 else 0)[0]:
                    break  # answered before the whole body
                sock.sendall(chunk)
            else:
                sock.sendall(b"0\r\n\r\n")
            head = sock.recv(64)
        except OSError:  # reset: an answer already in the socket is still read
            try:
                head = sock.recv(64)
            except OSError:
                return "closed"
    parts = head.split(b" ", 2)
    return parts[1].decode() if len(parts) > 1 and parts[0].startswith(b"HTTP/") else "closed"


# ---- the attacks ------------------------------------------------------------------------------

def _empty_arrays_frame(total_bytes: int) -> bytes:
    """A valid frame whose ``tables`` is ``total_bytes`` of empty msgpack arrays."""
    return _declared_array_frame(total_bytes) + b"\x90" * total_bytes


def _declared_array_frame(count: int) -> bytes:
    """A frame whose ``tables`` declares ``count`` items and holds none."""
    head = msgpack.packb({"v": PROTOCOL_VERSION, "counts": [1]})
    return bytes([0x83]) + head[1:] + b"\xa6tables" + b"\xdd" + struct.pack(">I", count)


def _huge_topk_push() -> bytes:
    """A push of a few hundred bytes declaring a [2^25, 4] float64 top-k gradient."""
    small = np.zeros((8, DIM), dtype=np.float64)
    small[0, 0] = 1.0
    grads = get_codec("topk").to_wire(small).to_wire()
    ids = get_codec("none").to_wire(PROBE_IDS[:8]).to_wire()
    grads["shape"], ids["shape"] = [2**25, DIM], [2**25]
    return encode_message({"client": 9, "seq": 1, "tables": [SCRATCH], "counts": [2**25],
                           "ids": ids, "grads": [grads]})


def _huge_ids_lookup() -> bytes:
    ids = get_codec("none").to_wire(PROBE_IDS[:1]).to_wire()
    ids["shape"] = [2**30]
    return encode_message({"tables": [SCRATCH], "counts": [2**30], "ids": ids})


def _grad(value: float) -> np.ndarray:
    return np.full((PROBE_IDS.size, DIM), value, dtype=np.float32)


def _first_push() -> bytes:
    return push_frame("dedup", PROBE_IDS, _grad(-1.0), client=7, seq=1)


async def _push_then_fresh_clients(shard: ShardProcess, timeout: float) -> None:
    """The dedup attack's set-up: a push, then pushes from 1,100 fresh clients (to rows
    not compared), enough to push the first client out of a window of 1,024."""
    await send_frame(shard.address, "Push", _first_push(), timeout)
    for client in range(1000, 2100):
        await send_frame(shard.address, "Push", push_frame(
            SCRATCH, PROBE_IDS[:1], _grad(0.0)[:1], client=client, seq=1), timeout)


@dataclass(frozen=True)
class Attack:
    name: str
    what: str
    # (shard, timeout) -> answer; runs after ``setup`` and the snapshot
    act: Callable[[ShardProcess, float], Awaitable[str]]
    setup: Callable[[ShardProcess, float], Awaitable[Any]] | None = None


def _frame(method: str, make: Callable[[], bytes]) -> Callable[[ShardProcess, float],
                                                               Awaitable[str]]:
    async def act(shard: ShardProcess, timeout: float) -> str:
        return await send_frame(shard.address, method, make(), timeout)
    return act


def _admin(method: str, path: str, **kw: Any) -> Callable[[ShardProcess, float],
                                                          Awaitable[str]]:
    async def act(shard: ShardProcess, timeout: float) -> str:
        return await asyncio.to_thread(admin, shard.admin_port, method, path,
                                       timeout=timeout, **kw)
    return act


def _table_body(**fields: Any) -> bytes:
    return json.dumps({"name": "attack", "dim": DIM, **fields}).encode()


ATTACKS = [
    Attack("tag_workers_6e6", "Lookup tagged [0, 0, 6,000,000]",
           _frame("Lookup", lambda: lookup_frame(SCRATCH, PROBE_IDS, tag=[0, 0, 6_000_000]))),
    Attack("tag_workers_2e62", "Lookup tagged [0, 0, 2^62]",
           _frame("Lookup", lambda: lookup_frame(SCRATCH, PROBE_IDS, tag=[0, 0, 2**62]))),
    Attack("declared_ids_2e30", "Lookup whose 8-byte ids declare 2^30 of them",
           _frame("Lookup", _huge_ids_lookup)),
    Attack("declared_topk_2e25", "Push declaring a [2^25, 4] float64 top-k gradient",
           _frame("Push", _huge_topk_push)),
    Attack("empty_arrays_16mib", "a 16 MiB frame of empty arrays",
           _frame("Lookup", lambda: _empty_arrays_frame(16 * 2**20))),
    Attack("declared_array_2e32", "a frame declaring an array of 2^32 - 1 items",
           _frame("Lookup", lambda: _declared_array_frame(2**32 - 1))),
    Attack("sgd_fp32_3e38", "SGD (lr 4) fp32 rows, gradient 3e38",
           _frame("Push", lambda: push_frame("sgd", PROBE_IDS, _grad(3e38), seq=11))),
    Attack("sgd_fp16_1e6", "SGD fp16 rows, gradient 1e6",
           _frame("Push", lambda: push_frame("sgd16", PROBE_IDS, _grad(1e6), seq=12))),
    Attack("adagrad_1e20", "Adagrad, gradient 1e20",
           _frame("Push", lambda: push_frame("adagrad", PROBE_IDS, _grad(1e20), seq=13))),
    Attack("ftrl_1e20", "FTRL, gradient 1e20",
           _frame("Push", lambda: push_frame("ftrl", PROBE_IDS, _grad(1e20), seq=14))),
    Attack("dedup_forgets", "after a push and 1,100 fresh clients' pushes, its retry",
           _frame("Push", _first_push), setup=_push_then_fresh_clients),
    Attack("admin_chunked_20mib", "POST /v1/tables with a chunked 20 MiB body",
           _admin("POST", "/v1/tables", chunks=20)),
    Attack("admin_read_no_token", "GET a row without the token",
           _admin("GET", f"/v1/tables/sgd/rows/{int(PROBE_IDS[0])}", token=False)),
    Attack("admin_path_outside", "POST /v1/tables with storage.path outside the data dir",
           _admin("POST", "/v1/tables", body=_table_body(storage={
               "tier": "disk", "ram_rows": 16,
               "path": f"{tempfile.gettempdir()}/../{tempfile.gettempdir()}/persimmon-abuse-outside"}))),
    Attack("admin_capacity_2e31", "POST /v1/tables with initial_capacity 2^31",
           _admin("POST", "/v1/tables", body=_table_body(initial_capacity=2**31))),
]


# ---- the run ----------------------------------------------------------------------------------

async def _seed(shard: ShardProcess) -> None:
    """Probe rows in every compared table, pushed to once so that they are not zero."""
    for k, table in enumerate(TABLES):
        if table != "dedup":
            answer = await send_frame(shard.address, "Push", push_frame(
                table, PROBE_IDS, _grad(0.25), client=100 + k, seq=1), 60)
            if not answer.startswith("OK"):
                raise RuntimeError(f"seeding table {table} failed: {answer}")


def _nonfinite_rows(snap: dict[str, bytes]) -> int:
    """Probe rows whose values or state are not all finite (rows travel as float32, and
    every optimizer's state is float32)."""
    bad = 0
    for raw in snap.values():
        if raw == b"error":
            continue
        values = np.frombuffer(raw, np.float32).reshape(PROBE_IDS.size, -1)
        bad += int((~np.isfinite(values)).any(axis=1).sum())
    return bad


def _refused(answer: str) -> bool:
    """Whether an answer applied nothing: an error, or a push acknowledged with 0 rows."""
    return not answer.startswith("OK") or " applied=0 " in answer + " "


def _rows_differing(before: bytes, after: bytes) -> int:
    """Probe rows that differ bit for bit (all of them when one side is an error)."""
    if len(before) != len(after) or len(before) % PROBE_IDS.size:
        return PROBE_IDS.size
    old, new = (np.frombuffer(b, np.uint8).reshape(PROBE_IDS.size, -1) for b in (before, after))
    return int((old != new).any(axis=1).sum())


async def _attack(shard: ShardProcess, prober: Prober, attack: Attack, timeout: float
                  ) -> dict[str, Any]:
    if attack.setup is not None:
        await attack.setup(shard, timeout)
    before = await snapshot(shard.address)
    rss_before, _ = shard.memory_kb()
    shard.reset_peak()
    await asyncio.sleep(0.05)
    prober.mark()
    started = time.perf_counter()
    try:
        answer = await asyncio.wait_for(attack.act(shard, timeout), timeout)
    except TimeoutError:
        answer = "timeout"
    answer_ms = 1e3 * (time.perf_counter() - started)
    await asyncio.sleep(0.1)  # a stall the answer came before
    stall_ms = prober.stall_ms()
    row: dict[str, Any] = {"attack": attack.name, "what": attack.what, "answer": answer,
                           "answer_ms": answer_ms, "stall_ms": stall_ms}
    if not shard.alive():
        return {**row, "answer": "died", "rss_mb": None, "rows_changed": None}
    _, peak = shard.memory_kb()
    row["rss_mb"] = max(0, peak - rss_before) / 1024
    if answer == "timeout":
        row["rows_changed"] = None
        return row
    after = await snapshot(shard.address)
    row["rows_changed"] = sum(_rows_differing(before[t], after[t]) for t in TABLES)
    row["refused"] = _refused(answer)
    row["nonfinite_rows"] = _nonfinite_rows(after)
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    chosen = [a for a in ATTACKS if not args.only or a.name in args.only.split(",")]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="persimmon-abuse-") as tmp:
        work = Path(tmp)
        shard: ShardProcess | None = None
        prober: Prober | None = None
        try:
            for attack in chosen:
                if shard is None or not shard.alive():
                    shard = ShardProcess(work, args.max_gb)
                    asyncio.run(_seed(shard))
                    prober = Prober(shard.admin_port)
                    prober.start()
                assert prober is not None
                console.print(f"[dim]{attack.name}: {attack.what}[/]")
                row = asyncio.run(_attack(shard, prober, attack, args.timeout_s))
                rows.append(row)
                if row["answer"] in ("timeout", "died"):
                    prober.stop()
                    shard.stop()
                    shard = None
        finally:
            if prober is not None:
                prober.stop()
            if shard is not None:
                shard.stop()
    changed = [r["rows_changed"] for r in rows]
    return {
        "rows": rows,
        "abuse_cases": len(rows),
        "abuse_max_stall_ms": max(r["stall_ms"] for r in rows),
        "abuse_max_answer_ms": max(r["answer_ms"] for r in rows),
        "abuse_max_rss_mb": max((r["rss_mb"] for r in rows if r["rss_mb"] is not None),
                                default=None) if all(r["rss_mb"] is not None for r in rows)
        else None,
        # rows a refused request changed, and rows left NaN/Inf by any request
        "abuse_rows_changed": sum(r["rows_changed"] for r in rows if r.get("refused"))
        if None not in changed else None,
        "abuse_rows_nonfinite": max((r["nonfinite_rows"] for r in rows
                                     if "nonfinite_rows" in r), default=0),
    }


def show(result: dict[str, Any]) -> None:
    table = Table(title="bench abuse: hostile requests against one live shard")
    for column in ("attack", "answer", "answer ms", "/healthz stall ms", "RSS +MiB",
                   "rows changed", "non-finite rows"):
        table.add_column(column)
    for r in result["rows"]:
        table.add_row(r["attack"], r["answer"], f"{r['answer_ms']:.0f}", f"{r['stall_ms']:.0f}",
                      "-" if r["rss_mb"] is None else f"{r['rss_mb']:.1f}",
                      "-" if r["rows_changed"] is None else str(r["rows_changed"]),
                      str(r.get("nonfinite_rows", "-")))
    Console().print(table)
    keys = ("abuse_cases", "abuse_max_stall_ms", "abuse_max_answer_ms", "abuse_max_rss_mb",
            "abuse_rows_changed", "abuse_rows_nonfinite")
    print(json.dumps({k: result[k] for k in keys}))


def register_bench(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("abuse", help="hostile requests against a live PS shard")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--only", help="comma-separated attack names (default: all)")
    parser.add_argument("--timeout-s", type=float, default=20.0,
                        help="how long an attack may take before it counts as a hang")
    parser.add_argument("--max-gb", type=float, default=8.0,
                        help="the shard's address-space cap (GiB), so runaway allocations fail")
    parser.set_defaults(func=main_of(run, show))
