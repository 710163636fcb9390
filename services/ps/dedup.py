"""Idempotent pushes: a shard's bounded memory of the pushes it applied, per client.

Every push over the wire carries its origin ``(client, seq, epoch)``: a client id drawn at
random by the client, a sequence number the client raises by one per push message to this
shard (a retry resends the same message, so the same number) and the shard's epoch the client
knows (0: none given, an older client; :mod:`services.ps.durability`). :class:`PushWindow`
remembers, per (epoch, client), the highest number applied and every number applied within the last ``window`` below
it, each with a fingerprint of the message and the ack the shard answered. A push is then:

- new (above the highest, or inside the window and not applied yet): applied, remembered;
- already applied, same fingerprint (a retry): not applied again, answered with its ack;
- already applied, another fingerprint (a number reused for a different push: other tables,
  counts, ids or lengths, or gradients that differ in size or in their first
  ``SAMPLED_BYTES`` bytes), or in flight for a request on other tables:
  :class:`FailedPrecondition`, nothing applied;
- below the window (too old to tell): :class:`FailedPrecondition`, nothing applied.

At most ``max_clients`` clients are remembered whole (:class:`~services.ps.config.PSConfig`
``dedup_clients``, sized from the job's ``max_workers``); a new one evicts the least recently
seen, which leaves only its highest number (a few bytes, up to ``max_evicted`` of them): if it
comes back, a push above that number is new and applied, one at or below it may be a retry
and is refused (FAILED_PRECONDITION, nothing applied), never applied twice. Past
``max_evicted``, the oldest of those go too and the window has *forgotten* clients: from then
on a push from a client it does not know whose number is above 1 (its first push to this
shard would be 1) may be a retry of a forgotten one and is refused the same way; such a
client starts over with a new client id. The window travels in the shard's checkpoints
(:meth:`PushWindow.snapshot` / :meth:`PushWindow.restore`), taken under the same table locks
as the rows, so a restored shard knows exactly the pushes its rows hold.

Thread-safe: :meth:`claim` and :meth:`commit` run under the pushed tables' locks, in any
thread; one lock guards the window itself.
"""

from __future__ import annotations

import threading
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from services.common.errors import FailedPrecondition, InvalidArgument
from services.ps.store import PushResult

__all__ = ["DEFAULT_MAX_CLIENTS", "DEFAULT_WINDOW", "SAMPLED_BYTES", "PushOrigin", "PushWindow",
           "WindowCounters", "fingerprint"]

DEFAULT_WINDOW = 1024
DEFAULT_MAX_CLIENTS = 1024  # at ~0.2 MB per client with a full window: ~200 MB at the cap
EVICTED_PER_CLIENT = 16  # evicted clients' highest numbers kept per client kept whole
SAMPLED_BYTES = 4096  # of each gradient array, in a push's fingerprint
_MAX = 2**63  # client ids and sequence numbers are non-negative int64 (msgpack ints)


class PushOrigin(NamedTuple):
    """Who sent a push: the client's id, the push's sequence number on this shard and the
    shard's epoch the client knew (0: none given)."""

    client: int
    seq: int
    epoch: int = 0


def fingerprint(meta: tuple[Any, ...], whole: Sequence[np.ndarray],
                sampled: Sequence[np.ndarray] = ()) -> int:
    """A CRC-32 of a push's content, to tell a retry (the same message) from a sequence
    number reused for another push: ``meta`` (table names, counts), every byte of ``whole``
    (ids, lengths), and the size and first ``SAMPLED_BYTES`` bytes of each of ``sampled``
    (gradients: hashing all of them would cost a tenth of a push)."""
    crc = zlib.crc32(repr((meta, [a.nbytes for a in sampled])).encode())
    for a in whole:
        crc = zlib.crc32(_bytes(a), crc)
    for a in sampled:
        data = _bytes(a)
        crc = zlib.crc32(data if data.nbytes <= SAMPLED_BYTES
                         else data.cast("B")[:SAMPLED_BYTES], crc)
    return crc


def _bytes(a: np.ndarray) -> memoryview:
    return (a if a.flags.c_contiguous else np.ascontiguousarray(a)).data


@dataclass(frozen=True, slots=True)
class WindowCounters:
    """What a :class:`PushWindow` holds and has done (:meth:`PushWindow.stats`)."""

    clients: int  # remembered whole
    entries: int  # applied pushes remembered, over those clients
    evicted: int  # clients evicted so far
    evicted_kept: int  # evicted clients whose highest number is still kept
    forgot: bool  # whether an evicted client's highest number was dropped too
    retries: int  # pushes answered from the window instead of applied


@dataclass(slots=True)
class _Client:
    highest: int = 0  # 0: none applied yet (sequence numbers start at 1)
    # seq → (fingerprint, applied, dropped_nonfinite, not_admitted): the ack, packed
    applied: dict[int, tuple[int, int, int, int]] = field(default_factory=dict)
    pending: dict[int, int] = field(default_factory=dict)  # seq → fp, being applied
    floor: int = 0  # numbers at or below it are refused: those of a client evicted earlier


class PushWindow:
    """Per-client windows of applied sequence numbers with their acks (see the module)."""

    def __init__(self, window: int = DEFAULT_WINDOW,
                 max_clients: int = DEFAULT_MAX_CLIENTS, max_evicted: int | None = None) -> None:
        if window < 1 or max_clients < 1:
            raise ValueError(f"window and max_clients must be >= 1, got {window}, {max_clients}")
        self.window = window
        self.max_clients = max_clients
        self.max_evicted = EVICTED_PER_CLIENT * max_clients if max_evicted is None \
            else max_evicted
        self._evicted: OrderedDict[tuple[int, int], int] = OrderedDict()  # key → highest
        self.forgot = False  # whether an evicted client's highest number was dropped too
        # (epoch, client) → window, least recently seen first
        self._clients: OrderedDict[tuple[int, int], _Client] = OrderedDict()
        self._lock = threading.Lock()
        self.evicted = 0
        self.retries = 0  # pushes answered from the window instead of applied

    @staticmethod
    def check_origin(origin: PushOrigin) -> PushOrigin:
        """``origin`` if well formed, else :class:`InvalidArgument`."""
        client, seq, epoch = origin
        if type(epoch) is not int or not 0 <= epoch < _MAX:
            raise InvalidArgument(f"push epoch must be an int in [0, 2**63), got {epoch!r}")
        if type(client) is not int or not 0 <= client < _MAX:
            raise InvalidArgument(f"push client id must be an int in [0, 2**63), got {client!r}")
        if type(seq) is not int or not 1 <= seq < _MAX:
            raise InvalidArgument(f"push sequence number must be an int in [1, 2**63), "
                                  f"got {seq!r}")
        return origin

    def claim(self, origin: PushOrigin, fp: int) -> PushResult | None:
        """The ack of an already applied push (a retry), or None when the caller must apply it
        and then :meth:`commit` (or :meth:`abandon`); raises when it must not be applied."""
        client, seq, epoch = self.check_origin(origin)
        with self._lock:
            state = self._touch((epoch, client), seq)
            done = state.applied.get(seq)
            if done is not None:
                if done[0] != fp:
                    raise FailedPrecondition(
                        f"push sequence number {seq} of client {client:#x} was already used for "
                        "a different push; nothing applied")
                self.retries += 1
                return PushResult(*done[1:])
            if seq in state.pending:
                raise FailedPrecondition(
                    f"push sequence number {seq} of client {client:#x} is being applied by "
                    "another push; nothing applied")
            low = max(state.highest - self.window, state.floor)
            if seq <= low:
                raise FailedPrecondition(
                    f"push sequence number {seq} of client {client:#x} is below this shard's "
                    f"window ({low + 1}..{state.highest}): too old to tell whether it was "
                    "applied; nothing applied")
            state.pending[seq] = fp
            return None

    def commit(self, origin: PushOrigin, result: PushResult) -> None:
        """Remember that the claimed push ``origin`` was applied and answered ``result``."""
        client, seq, epoch = origin
        with self._lock:
            state = self._clients[epoch, client]  # one with a claim in flight is never evicted
            fp = state.pending.pop(seq)
            state.applied[seq] = (fp, result.applied, result.dropped_nonfinite,
                                  result.not_admitted)
            if seq > state.highest:
                state.highest = seq
            if len(state.applied) > self.window + self.window // 4 + 1:  # amortised
                low = state.highest - self.window
                state.applied = {s: v for s, v in state.applied.items() if s > low}

    def abandon(self, origin: PushOrigin) -> None:
        """Forget a claim whose push failed before it changed anything."""
        client, seq, epoch = origin
        with self._lock:
            state = self._clients.get((epoch, client))
            if state is not None:
                state.pending.pop(seq, None)

    def _touch(self, client: tuple[int, int], seq: int) -> _Client:
        state = self._clients.get(client)
        if state is not None:
            self._clients.move_to_end(client)
            return state
        highest = self._evicted.pop(client, 0)
        if not highest and self.forgot and seq > 1:
            raise FailedPrecondition(
                f"push sequence number {seq} of client {client[1]:#x} may be a retry of a push "
                f"this shard has forgotten (more than {self.max_evicted} clients were evicted "
                "from its window since): nothing applied; start over with a new client id")
        while len(self._clients) >= self.max_clients and self._evict_one():
            pass
        state = self._clients[client] = _Client(highest=highest, floor=highest)
        return state

    def _evict_one(self) -> bool:
        for client, state in self._clients.items():  # least recently seen first
            if not state.pending:
                del self._clients[client]
                self.evicted += 1
                self._evicted[client] = max(state.highest, state.floor)
                while len(self._evicted) > self.max_evicted:
                    self._evicted.popitem(last=False)
                    self.forgot = True
                return True
        return False

    def stats(self) -> WindowCounters:
        with self._lock:
            return WindowCounters(
                clients=len(self._clients),
                entries=sum(len(s.applied) for s in self._clients.values()),
                evicted=self.evicted, evicted_kept=len(self._evicted), forgot=self.forgot,
                retries=self.retries)

    # ---- checkpoints ----------------------------------------------------------------------

    def snapshot(self) -> dict[str, np.ndarray]:
        """The applied pushes as arrays (clients least recently seen first; pending claims
        are left out: their rows are not applied either)."""
        with self._lock:
            clients = list(self._clients.items())
            entries = [(i, seq, done) for i, (_, state) in enumerate(clients)
                       for seq, done in state.applied.items()]
            evicted = list(self._evicted.items())
            forgot = self.forgot
        return {
            **_evicted_arrays(evicted, forgot),
            "clients": np.array([c for (_, c), _ in clients], dtype=np.uint64),
            "client_epochs": np.array([e for (e, _), _ in clients], dtype=np.int64),
            "highest": np.array([max(s.highest, s.floor) for _, s in clients], dtype=np.int64),
            "entry_client": np.array([e[0] for e in entries], dtype=np.int64),
            "entry_seq": np.array([e[1] for e in entries], dtype=np.int64),
            "entry_fp": np.array([e[2][0] for e in entries], dtype=np.uint64),
            "entry_ack": np.array([e[2][1:] for e in entries], dtype=np.int64).reshape(-1, 3),
        }

    def restore(self, arrays: dict[str, np.ndarray] | None) -> None:
        """Replace the window by a :meth:`snapshot`'s (None: empty; one without
        ``client_epochs``, an older checkpoint's: epoch 0)."""
        clients: OrderedDict[tuple[int, int], _Client] = OrderedDict()
        evicted, forgot = _evicted_of(arrays)
        if arrays is not None:
            _check_snapshot(arrays)
            epochs = arrays.get("client_epochs", np.zeros(arrays["clients"].shape, np.int64))
            if epochs.shape != arrays["clients"].shape:
                raise FailedPrecondition("push window snapshot arrays do not fit together")
            for client, epoch, highest in zip(arrays["clients"].tolist(), epochs.tolist(),
                                              arrays["highest"].tolist(), strict=True):
                clients[int(epoch), int(client)] = _Client(highest=int(highest),
                                                           floor=int(highest))
            order = list(clients.values())
            for i, seq, fp, ack in zip(arrays["entry_client"].tolist(),
                                       arrays["entry_seq"].tolist(),
                                       arrays["entry_fp"].tolist(),
                                       arrays["entry_ack"].tolist(), strict=True):
                order[i].applied[int(seq)] = (int(fp), *(int(x) for x in ack))
        with self._lock:
            self._clients = clients
            self._evicted, self.forgot = evicted, forgot


_SNAPSHOT_KEYS = ("clients", "highest", "entry_client", "entry_seq", "entry_fp", "entry_ack")


def _check_snapshot(arrays: dict[str, np.ndarray]) -> None:
    missing = [k for k in _SNAPSHOT_KEYS if k not in arrays]
    if missing:
        raise FailedPrecondition(f"push window snapshot lacks {missing}")
    n, e = arrays["clients"].shape[0], arrays["entry_seq"].shape[0]
    ok = arrays["highest"].shape == (n,) and arrays["entry_ack"].shape == (e, 3) \
        and arrays["entry_client"].shape == arrays["entry_fp"].shape == (e,) \
        and (e == 0 or 0 <= int(arrays["entry_client"].min()) <= int(
            arrays["entry_client"].max()) < n)
    if not ok:
        raise FailedPrecondition("push window snapshot arrays do not fit together")


def _evicted_arrays(evicted: list[tuple[tuple[int, int], int]], forgot: bool
                    ) -> dict[str, np.ndarray]:
    """The evicted clients' highest numbers (oldest first) and the forgot flag, as arrays."""
    return {"evicted_epochs": np.array([e for (e, _), _ in evicted], dtype=np.int64),
            "evicted_clients": np.array([c for (_, c), _ in evicted], dtype=np.uint64),
            "evicted_highest": np.array([h for _, h in evicted], dtype=np.int64),
            "forgot": np.array([int(forgot)], dtype=np.int64)}


def _evicted_of(arrays: dict[str, np.ndarray] | None
                ) -> tuple[OrderedDict[tuple[int, int], int], bool]:
    """:func:`_evicted_arrays` read back (none in an older checkpoint's snapshot)."""
    evicted: OrderedDict[tuple[int, int], int] = OrderedDict()
    if arrays is None or "evicted_clients" not in arrays:
        return evicted, False
    keys = ("evicted_epochs", "evicted_clients", "evicted_highest")
    parts = [np.asarray(arrays.get(k, np.zeros((0, 0)))) for k in keys]
    if any(p.ndim != 1 or p.shape != parts[1].shape for p in parts):
        raise FailedPrecondition("push window snapshot's evicted clients do not fit together")
    for epoch, client, highest in zip(*(p.tolist() for p in parts), strict=True):
        evicted[int(epoch), int(client)] = int(highest)
    return evicted, bool(arrays.get("forgot", np.zeros(1, np.int64)).any())
