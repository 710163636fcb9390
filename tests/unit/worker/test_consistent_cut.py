"""ConsistentCut through its seams (a drain callable, the shared checkpoint root): a rank
meets the others only once drained and goes on only once the cut is complete; ranks at
different steps make no cut (each waits for the other, then gives up)."""

from __future__ import annotations

import asyncio

import pytest

from services.common.checkpoints import latest_complete
from services.common.errors import InvalidArgument, Unavailable
from services.worker.job_checkpoints import ConsistentCut, JobCheckpointer
from tests.conftest import eventually


async def test_a_rank_meets_the_others_once_drained_and_goes_on_once_the_cut_is_complete(
        tmp_path) -> None:
    drained = asyncio.Event()
    rank1 = ConsistentCut(tmp_path, rank=1, world=2, run="r", timeout_s=30)
    rank1.trained({"kafka:t:0": (0, 49)})
    cut = asyncio.create_task(rank1.cut(4, drain=drained.wait))
    published = tmp_path / "cut-r-0000000004" / "ranks" / "rank-1.json"
    await asyncio.sleep(0.05)
    assert not published.exists()  # pushes still in flight: not at the barrier yet
    drained.set()
    await eventually(published.exists)
    await asyncio.sleep(0.05)
    assert not cut.done()  # no push after the cut before rank 0 wrote it whole
    cut.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cut


async def test_ranks_at_different_steps_make_no_cut(tmp_path) -> None:
    with pytest.raises(InvalidArgument, match="checkpointer"):
        ConsistentCut(tmp_path, rank=0, world=2, run="r")
    with pytest.raises(InvalidArgument, match="rank must be"):
        ConsistentCut(tmp_path, rank=2, world=2, run="r")

    async def drained() -> None:
        pass

    rank1 = ConsistentCut(tmp_path, rank=1, world=2, run="r", timeout_s=0.01)
    with pytest.raises(Unavailable, match="rank 0's manifest did not come"):
        await rank1.cut(3, drain=drained)  # rank 1 at step 3 ...
    rank0 = ConsistentCut(tmp_path, rank=0, world=2, run="r", timeout_s=0.01,
                          checkpointer=JobCheckpointer(tmp_path, admin_urls=[]))
    with pytest.raises(Unavailable, match="every rank's positions did not come"):
        await rank0.cut(4, drain=drained, dense=b"")  # ... and rank 0 at step 4
    assert latest_complete(tmp_path) is None
