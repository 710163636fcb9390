"""A push is applied at most once even after its client left the dedup window (issue 45).

The window kept 1,024 clients, hard-coded: 1,024 pushes from fresh client ids, then a retry
of an older one, applied the retry twice. Its size now comes from the shard's config, and an
evicted client leaves its highest sequence number behind, so a push of it that may be a retry
is refused (FAILED_PRECONDITION, nothing applied) while its new pushes go on. Real shards,
real tables.
"""

from __future__ import annotations

import numpy as np
import pytest

from services.common.errors import FailedPrecondition
from services.ps.config import PSConfig
from services.ps.dedup import PushOrigin, PushWindow
from services.ps.shard import Shard
from services.ps.tables import OptimizerConfig, TableConfig

ROW = np.array([1], np.uint64)


def shard(**config) -> Shard:
    table = TableConfig(name="t", dim=4, optimizer=OptimizerConfig(kind="sgd", lr=1.0))
    return Shard(PSConfig(tables=[table], **config))


def push(s: Shard, client: int, seq: int, ids: np.ndarray = ROW, value: float = 1.0):
    return s.push_sync("t", ids, np.full((ids.size, 4), value, np.float32),
                       origin=PushOrigin(client, seq))


def row(s: Shard) -> np.ndarray:
    return s.table("t").lookup(ROW)[0]


def crowd_out(s: Shard, clients: int, first: int = 1000) -> None:
    """Pushes from ``clients`` fresh client ids (to another row)."""
    other = np.array([2], np.uint64)
    for client in range(first, first + clients):
        push(s, client, 1, other)


def test_a_retry_after_its_client_was_evicted_is_not_applied_twice():
    s = shard()
    push(s, 1, 1)
    once = row(s).copy()
    crowd_out(s, s.pushes.max_clients)  # client 1 evicted (the old code's 1,024)
    with pytest.raises(FailedPrecondition, match="sequence number 1 of client 0x1"):
        push(s, 1, 1)  # the retry
    np.testing.assert_array_equal(row(s), once)


def test_the_window_size_comes_from_the_config():
    assert shard(dedup_clients=8).pushes.max_clients == 8
    assert shard(max_workers=100).pushes.max_clients == 1024
    assert shard(max_workers=4096).pushes.max_clients == 8192  # the default: 2 per worker
    with pytest.raises(ValueError, match="dedup_clients"):
        PSConfig(dedup_clients=0)
    with pytest.raises(ValueError, match="max_workers"):
        PSConfig(max_workers=0)


def test_an_evicted_client_goes_on_with_new_pushes_and_no_retry_gets_through():
    s = shard(dedup_clients=2)
    for seq in (1, 2, 3):
        push(s, 1, seq)
    crowd_out(s, 2)
    before = row(s).copy()
    for seq in (1, 2, 3):  # each may be a retry: refused, nothing applied
        with pytest.raises(FailedPrecondition, match="too old to tell"):
            push(s, 1, seq)
    np.testing.assert_array_equal(row(s), before)
    assert push(s, 1, 4).applied == 1  # a new push: applied
    np.testing.assert_array_equal(row(s), before - 1)
    assert push(s, 1, 4).applied == 1  # and its retry answered from the window
    np.testing.assert_array_equal(row(s), before - 1)


def test_a_client_forgotten_entirely_cannot_slip_a_retry_in():
    s = shard(dedup_clients=1)
    push(s, 1, 7)  # a client first seen at 7 (its earlier pushes went to a restarted shard)
    crowd_out(s, s.pushes.max_evicted + 2)  # client 1's highest number dropped too
    assert s.pushes.stats().forgot
    before = row(s).copy()
    with pytest.raises(FailedPrecondition, match="new client id"):
        push(s, 1, 7)
    np.testing.assert_array_equal(row(s), before)
    assert push(s, 99_999, 1).applied == 1  # a new client (numbers from 1) goes on


def test_a_checkpointed_window_keeps_its_evicted_clients():
    window = PushWindow(max_clients=1)
    window.claim(PushOrigin(1, 5), 11)
    window.commit(PushOrigin(1, 5), push(shard(), 0, 1))
    window.claim(PushOrigin(2, 1), 12)  # client 1 evicted
    window.abandon(PushOrigin(2, 1))
    restored = PushWindow(max_clients=1)
    restored.restore(window.snapshot())
    with pytest.raises(FailedPrecondition, match="too old to tell"):
        restored.claim(PushOrigin(1, 5), 11)
    assert restored.claim(PushOrigin(1, 6), 13) is None
