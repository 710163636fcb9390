"""Two local ranks: the shadow thread never blocks training, the DDP comm-hook slot, failures."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

from services.common.errors import Internal
from services.worker.distributed import init_distributed, run_local_ranks
from services.worker.models import build_model
from services.worker.sync import make_sync
from services.worker.sync.base import flatten, mean_allreduce


class CountingState:
    """A hook state that reports the bytes it put on the wire, as the compression hooks do."""

    def __init__(self) -> None:
        self.calls = 0
        self.wire_bytes = 0


def counting_fp16_hook(state: CountingState, bucket: dist.GradBucket
                       ) -> torch.futures.Future[torch.Tensor]:
    state.calls += 1
    state.wire_bytes += bucket.buffer().numel() * 2
    return fp16_compress_hook(None, bucket)


class HeldAverager:
    """The default mean all-reduce, entered only once ``release`` is set: it holds the shadow
    thread inside its round for as long as the test wants."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, flat: torch.Tensor, group: Any, size: int) -> torch.Tensor:
        self.entered.set()
        if not self.release.wait(timeout=60):
            raise TimeoutError("the test never released the shadow round")
        return mean_allreduce(flat, group, size)


MOVE = 0.01  # what rank r's training adds to every parameter per held step: (r + 1)·MOVE


def shadow_never_blocks(rank: int) -> dict[str, Any]:
    """The shadow thread is held inside its first round while training takes 30 steps that
    move the parameters; the round's result must keep those moves."""
    held = HeldAverager()
    sync = make_sync("shadow", averager=held)
    sync.prepare(torch.nn.Linear(64, 64))
    start = flatten(sync.params)                     # equal on both ranks after prepare
    with torch.no_grad():
        for p in sync.params:
            p.add_(float(rank))
    sync.after_step(0)                               # hands the first snapshot over
    out: dict[str, Any] = {"entered": held.entered.wait(timeout=60)}
    for step in range(1, 31):                        # the round cannot finish meanwhile
        with torch.no_grad():                        # while training moves the parameters
            for p in sync.params:
                p.add_((rank + 1) * MOVE)
        sync.after_step(step)
    out.update(steps_while_held=sync.stats.steps, syncs_while_held=sync.stats.syncs,
               in_flight_while_held=sync.rounds_in_flight)
    held.release.set()
    step = 31
    while sync.stats.syncs == 0:                     # applied at a later step boundary
        sync.after_step(step)
        step += 1
    # snapshots were start + rank (mean: start + 0.5); the 30 moves made meanwhile are kept
    out["after_round"] = float((flatten(sync.params) - start).sub(0.5).abs().max()), \
        float((flatten(sync.params) - start - 0.5 - 30 * (rank + 1) * MOVE).abs().max())
    sync.close()
    out["consensus"] = sync.consensus_distance()
    out["mean_param"] = float(flatten(sync.params).mean())
    return out


def ddp_with_comm_hook(rank: int) -> dict[str, Any]:
    torch.manual_seed(rank)
    model = build_model("dlrm", sparse_dims={"a": 4, "b": 4}, num_dense=2,
                        bottom_mlp=[8, 4], top_mlp=[8])
    state = CountingState()
    sync = make_sync("allreduce", comm_hook=(state, counting_fp16_hook))
    ddp = sync.prepare(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(10 + rank)
    for step in range(3):
        pooled = {k: torch.randn(8, 4, generator=g) for k in ("a", "b")}
        loss = ddp(pooled, torch.randn(8, 2, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        sync.after_backward(step)
        opt.step()
        sync.after_step(step)
    return {"calls": state.calls, "wire_bytes": state.wire_bytes,
            "bytes_sent": sync.stats.bytes_sent, "consensus": sync.consensus_distance(),
            "sync_seconds": sync.stats.sync_seconds,
            "param_count": sum(p.numel() for p in sync.params)}


def gossip_pair(rank: int) -> float:
    sync = make_sync("gossip", topology="ring")
    sync.prepare(torch.nn.Linear(2, 2))
    with torch.no_grad():
        for p in sync.params:
            p.fill_(float(rank * 4))
    sync.after_step(0)
    return float(flatten(sync.params).sub(2.0).abs().max())   # the pair's mean is 2


def two_rank_checks(rank: int, world: int) -> dict[str, Any]:
    info = init_distributed()      # already joined: describes the group
    return {"info": (info.rank, info.world_size, info.backend, info.initialized),
            "shadow": shadow_never_blocks(rank), "hook": ddp_with_comm_hook(rank),
            "gossip_pair": gossip_pair(rank)}


@pytest.fixture(scope="module")
def two() -> list[dict[str, Any]]:
    return run_local_ranks(two_rank_checks, 2, timeout_s=120)


def test_ranks_see_their_group(two: list[dict[str, Any]]) -> None:
    assert [r["info"] for r in two] == [(0, 2, "gloo", True), (1, 2, "gloo", True)]


def test_shadow_thread_never_blocks_the_training_step(two: list[dict[str, Any]]) -> None:
    for r in two:
        shadow = r["shadow"]
        assert shadow["entered"]                              # the thread is in its round
        assert shadow["steps_while_held"] == 31               # and training went on
        assert shadow["syncs_while_held"] == 0 and shadow["in_flight_while_held"] == 1
        assert shadow["consensus"] < 1e-6
        off_mean, off_kept = shadow["after_round"]
        assert off_kept < 1e-5          # the snapshots' mean plus this rank's held-round moves
        assert off_mean > 0.29          # (overwriting with the mean would lose the moves)
    assert two[0]["shadow"]["mean_param"] == pytest.approx(two[1]["shadow"]["mean_param"])


def test_ddp_comm_hook_slot_is_used_and_reports_wire_bytes(two: list[dict[str, Any]]) -> None:
    for r in two:
        h = r["hook"]
        assert h["calls"] >= 3
        assert h["wire_bytes"] == 3 * 2 * h["param_count"]   # fp16: half of the fp32 payload
        assert h["bytes_sent"] == h["wire_bytes"]
        assert h["consensus"] == 0.0
        assert h["sync_seconds"] > 0


def test_gossip_with_two_ranks_is_the_pair_average(two: list[dict[str, Any]]) -> None:
    assert all(r["gossip_pair"] == 0.0 for r in two)


def failing_rank(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("boom from rank one")
    return rank


def test_a_failing_rank_is_reported_with_its_traceback() -> None:
    with pytest.raises(Internal, match="(?s)local rank 1 failed.*boom from rank one"):
        run_local_ranks(failing_rank, 2, timeout_s=60)
