"""A table dropped while a lookup waits for it: the lookup answers NotFound (the error a
client maps to its status), never a bare KeyError, and the other tables stay served."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from services.common.errors import NotFound
from services.ps.config import PSConfig
from services.ps.shard import Shard
from tests.unit.ps.counting import counting_table


def test_a_lookup_waiting_while_its_table_is_dropped_answers_not_found():
    shard = Shard(PSConfig(tables=[counting_table("a"), counting_table("b")]))
    ids = np.arange(4, dtype=np.uint64)
    got: list[BaseException | np.ndarray] = []

    def lookup() -> None:
        try:
            got.append(shard.lookup_many_sync(["a", "b"], [2, 2], ids))
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            got.append(exc)

    with shard.table("a").lock:  # the lookup validates both tables, then waits for a's
        waiting = threading.Thread(target=lookup)
        waiting.start()
        time.sleep(0.2)
        assert waiting.is_alive()
        shard.drop_table("b")
    waiting.join(10)
    assert len(got) == 1 and isinstance(got[0], NotFound), got
    assert "'b'" in str(got[0])
    assert shard.lookup_many_sync(["a"], [2], ids[:2]).shape == (2, shard.tables["a"].dim)
    with pytest.raises(NotFound):
        shard.lookup_sync("b", ids)
