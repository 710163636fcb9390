"""Compressed dense collectives, 1-bit optimizers and DDP comm hooks on real gloo process groups.

Each fixture starts one group of local ranks (127.0.0.1, TCP rendezvous on a free port) and
runs several checks in it; the tests assert on what the ranks returned.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from services.worker.compression import (
    HOOK_NAMES,
    CodecAverager,
    OnebitAdam,
    OnebitLamb,
    OnebitReducer,
    make_comm_hook,
    padded_size,
)
from services.worker.distributed import run_local_ranks
from services.worker.sync import AllReduceSync

AR_NUMEL, AR_STEPS = 1003, 6          # not a multiple of 8·world: exercises the padding
LS_DIM, LS_ROWS, LS_STEPS, LS_FREEZE = 16, 64, 300, 60  # freeze after 20% of the steps
ADAM_LR, LAMB_LR = 0.05, 0.02


# --------------------------------------------------------------------------- shared problem
def _ar_input(step: int, rank: int) -> np.ndarray:
    return np.random.default_rng(1000 * step + rank).standard_normal(AR_NUMEL).astype(np.float32)


def _least_squares(world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A (world·rows × d), b = A·x* + noise and a random start; rank r owns rows r·rows…"""
    g = torch.Generator().manual_seed(7)
    a = torch.randn(world * LS_ROWS, LS_DIM, generator=g)
    x_star = torch.randn(LS_DIM, generator=g)
    b = a @ x_star + 0.5 * torch.randn(world * LS_ROWS, generator=g)
    return a, b, torch.randn(LS_DIM, generator=g)


def _ls_loss(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return ((a @ x - b) ** 2).mean()


def _train_least_squares(make_opt, rows: slice, world: int) -> tuple[float, np.ndarray]:
    """Train on ``rows``; return the loss on all rows and the final parameters."""
    a, b, x0 = _least_squares(world)
    x = nn.Parameter(x0.clone())
    opt = make_opt([x])
    for _ in range(LS_STEPS):
        opt.zero_grad()
        _ls_loss(x, a[rows], b[rows]).backward()
        opt.step()
    return float(_ls_loss(x.detach(), a, b)), x.detach().numpy().copy()


def _rows(rank: int) -> slice:
    return slice(rank * LS_ROWS, (rank + 1) * LS_ROWS)


# --------------------------------------------------------------------------- 4 ranks: 1-bit
def _onebit_rank(rank: int, world: int) -> dict:
    reducer = OnebitReducer()
    outs = [reducer.allreduce(torch.from_numpy(_ar_input(t, rank)), key="x").numpy()
            for t in range(AR_STEPS)]
    ew, es = reducer.errors("x")
    result = {"outs": np.stack(outs), "worker_error": ew.numpy().copy(),
              "server_error": es.numpy().copy(), "ar_bytes": reducer.stats.as_dict()}

    adams: list[OnebitAdam] = []
    adam_v: list[np.ndarray] = []  # v after every step, warm-up and compressed

    class RecordingAdam(OnebitAdam):
        def step(self, closure=None):  # type: ignore[no-untyped-def]
            out = super().step(closure)
            adam_v.append(_variances(self))
            return out

    def make_adam(params):  # type: ignore[no-untyped-def]
        adams.append(RecordingAdam(params, lr=ADAM_LR, freeze_step=LS_FREEZE))
        return adams[-1]

    adam_loss, adam_x = _train_least_squares(make_adam, _rows(rank), world)
    result.update(adam_loss=adam_loss, adam_x=adam_x, adam_bytes=adams[0].stats.as_dict(),
                  adam_v=np.stack(adam_v))

    factors: list[list[float]] = []
    lamb_v: list[np.ndarray] = []

    class RecordingLamb(OnebitLamb):
        def step(self, closure=None):  # type: ignore[no-untyped-def]
            compressed = self.compressing
            out = super().step(closure)
            lamb_v.append(_variances(self))
            if compressed:
                factors.append(list(self.last_factors))
            return out

    lamb_loss, lamb_x = _train_least_squares(
        lambda p: RecordingLamb(p, lr=LAMB_LR, freeze_step=LS_FREEZE, betas=(0.9, 0.99)),
        _rows(rank), world)
    result.update(lamb_loss=lamb_loss, lamb_x=lamb_x, lamb_factors=np.array(factors),
                  lamb_v=np.stack(lamb_v))
    return result


def _variances(opt: OnebitAdam | OnebitLamb) -> np.ndarray:
    """The variance the update divides by (1-bit LAMB's fresh one too, when it exists)."""
    st = next(iter(opt.state.values()))
    fresh = st.get("exp_avg_sq_fresh", torch.full_like(st["exp_avg_sq"], np.nan))
    return torch.stack([st["exp_avg_sq"], fresh]).numpy().copy()


@pytest.fixture(scope="module")
def onebit_ranks() -> list[dict]:
    return run_local_ranks(_onebit_rank, 4, timeout_s=120)


def _simulate_onebit(world: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The two-phase scheme in float64 numpy, all ranks in one process."""
    size = padded_size(AR_NUMEL, world)
    chunk = size // world
    ew = np.zeros((world, size))
    es = np.zeros((world, chunk))
    outs = []
    sign = lambda v: np.where(v < 0, -1.0, 1.0)  # noqa: E731
    for t in range(AR_STEPS):
        x = np.zeros((world, size))
        x[:, :AR_NUMEL] = [_ar_input(t, r) for r in range(world)]
        x += ew
        s = np.linalg.norm(x, axis=1) / np.sqrt(size)
        ew = x - s[:, None] * sign(x)
        compressed = (s[:, None] * sign(x)).reshape(world, world, chunk)  # [rank i, chunk j]
        y = compressed.mean(axis=0) + es
        s2 = np.linalg.norm(y, axis=1) / np.sqrt(chunk)
        es = y - s2[:, None] * sign(y)
        outs.append((s2[:, None] * sign(y)).reshape(-1)[:AR_NUMEL])
    return np.stack(outs), ew, es


def test_compressed_allreduce_identical_on_every_rank(onebit_ranks):
    first = onebit_ranks[0]["outs"]
    for r in onebit_ranks[1:]:
        assert np.array_equal(r["outs"].view(np.uint32), first.view(np.uint32))


def test_compressed_allreduce_matches_dense_simulation(onebit_ranks):
    outs, ew, es = _simulate_onebit(4)
    np.testing.assert_allclose(onebit_ranks[0]["outs"], outs, rtol=1e-5, atol=1e-5)
    for rank, r in enumerate(onebit_ranks):
        np.testing.assert_allclose(r["worker_error"], ew[rank], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(r["server_error"], es[rank], rtol=1e-4, atol=1e-5)


def test_compressed_allreduce_telescopes(onebit_ranks):
    """Σ out_t = Σ mean_i x_i,t − mean_i e_w,i,T − concat_j e_s,j,T."""
    world = len(onebit_ranks)
    total_out = onebit_ranks[0]["outs"].astype(np.float64).sum(axis=0)
    total_in = sum(np.mean([_ar_input(t, r) for r in range(world)], axis=0)
                   for t in range(AR_STEPS))
    ew = np.mean([r["worker_error"] for r in onebit_ranks], axis=0)
    es = np.concatenate([r["server_error"] for r in onebit_ranks])
    np.testing.assert_allclose(total_out, total_in - ew[:AR_NUMEL] - es[:AR_NUMEL], atol=1e-4)


def test_compressed_allreduce_byte_count(onebit_ranks):
    stats = onebit_ranks[0]["ar_bytes"]
    size = padded_size(AR_NUMEL, 4)
    assert stats["calls"] == AR_STEPS
    assert stats["wire_bytes"] == AR_STEPS * (size // 8 + 4 * 4 + size // 32 + 4)
    assert stats["ratio"] > 20


def test_onebit_adam_matches_adam_on_least_squares(onebit_ranks):
    """Adam on the whole data set equals 4 ranks averaging their gradients every step."""
    adam_loss, _ = _train_least_squares(lambda p: torch.optim.Adam(p, lr=ADAM_LR),
                                        slice(None), 4)
    a, b, x0 = _least_squares(4)
    initial = float(_ls_loss(x0, a, b))
    onebit_loss = onebit_ranks[0]["adam_loss"]
    assert adam_loss < initial / 20  # the baseline really converged
    assert abs(onebit_loss - adam_loss) <= 0.05 * adam_loss, (onebit_loss, adam_loss)
    for r in onebit_ranks[1:]:  # every rank holds the same parameters
        assert np.array_equal(r["adam_x"], onebit_ranks[0]["adam_x"])


@pytest.mark.parametrize("name", ["adam", "lamb"])
def test_onebit_variance_is_frozen_bit_for_bit_after_the_warm_up(onebit_ranks, name):
    """From the first compressed step on, v never changes by a single bit (a v updated from
    the decompressed momentum, even if equal on every rank, fails); 1-bit LAMB's v_fresh does
    move, so the records are live."""
    for r in onebit_ranks:
        v = r[f"{name}_v"]                          # (steps, [v, v_fresh], dim)
        assert v.shape == (LS_STEPS, 2, LS_DIM)
        frozen = v[LS_FREEZE:, 0]
        assert np.array_equal(frozen.view(np.uint32),
                              np.broadcast_to(frozen[0], frozen.shape).view(np.uint32))
        assert np.all(frozen[0] >= v[LS_FREEZE - 1, 0])   # the warm-up's v, floored at most
        assert not np.array_equal(v[LS_FREEZE - 2, 0], v[LS_FREEZE - 1, 0])  # it moved before
        assert np.array_equal(frozen, onebit_ranks[0][f"{name}_v"][LS_FREEZE:, 0])
    if name == "lamb":
        fresh = onebit_ranks[0]["lamb_v"][LS_FREEZE:, 1]
        assert not np.array_equal(fresh[0], fresh[-1])


def test_onebit_adam_sends_less(onebit_ranks):
    stats = onebit_ranks[0]["adam_bytes"]
    assert stats["steps"] == LS_STEPS
    warmup = LS_FREEZE * 4 * LS_DIM
    assert stats["wire_bytes"] - warmup < (stats["raw_bytes"] - warmup) / 2  # tiny d: padding
    assert stats["raw_bytes"] == LS_STEPS * 4 * LS_DIM


def test_onebit_lamb_factor_bounded_and_converges(onebit_ranks):
    r0 = onebit_ranks[0]
    factors = r0["lamb_factors"]
    assert factors.shape == (LS_STEPS - LS_FREEZE, 1)
    assert factors.min() >= 0.5 and factors.max() <= 4.0
    steps = np.vstack([np.ones((1, 1)), factors])
    assert np.abs(steps[1:] / steps[:-1] - 1).max() <= 0.1 + 1e-9
    assert factors.max() - factors.min() > 0.01  # the factor really moved
    lamb_loss, _ = _train_least_squares(  # uncompressed LAMB: never leaves the warm-up
        lambda p: OnebitLamb(p, lr=LAMB_LR, freeze_step=LS_STEPS + 1, betas=(0.9, 0.99)),
        slice(None), 4)
    assert abs(r0["lamb_loss"] - lamb_loss) <= 0.1 * lamb_loss, (r0["lamb_loss"], lamb_loss)
    for r in onebit_ranks[1:]:
        assert np.array_equal(r["lamb_x"], r0["lamb_x"])


# --------------------------------------------------------------------------- 2 ranks: hooks
HOOK_PARAMS = {"dct": {"keep": 0.1, "refresh": 5}, "topk": {"keep": 0.1},
               "qsgd": {"levels": 15, "bucket": 64}, "adaquant": {"s0": 2, "bucket": 64},
               "int8+zstd": {}}
HOOK_STEPS = 30


def _tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))


def _hook_rank(rank: int, world: int) -> dict:
    out: dict = {}
    g = torch.Generator().manual_seed(100 + rank)
    xs = torch.randn(HOOK_STEPS, 32, 8, generator=g)
    w_true = torch.linspace(-1, 1, 8)
    for name in (*HOOK_NAMES, "int8+zstd"):
        model = DistributedDataParallel(_tiny_model(), bucket_cap_mb=0.001)
        state, hook = make_comm_hook(name, **HOOK_PARAMS.get(name, {}))
        model.register_comm_hook(state, hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = []
        for step in range(HOOK_STEPS):
            x = xs[step]
            loss = ((model(x).squeeze(1) - x @ w_true) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss))
            if hasattr(state, "report_loss"):
                state.report_loss(float(loss))
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()
        out[name] = {"params": flat, "losses": losses, "stats": state.stats.as_dict()}
    out["sync"] = _through_sync_strategies(xs, w_true)
    averager = CodecAverager("dct", keep=0.2)
    v = torch.from_numpy(np.random.default_rng(rank).standard_normal(500).astype(np.float32))
    out["averager"] = averager(v.clone(), None, world).numpy()
    out["averager_input"] = v.numpy()
    dist.barrier()
    return out


def _through_sync_strategies(xs: torch.Tensor, w_true: torch.Tensor) -> dict:
    """The hooks and averagers plugged into the worker's AllReduceSync, as the trainer does."""
    result = {}
    hooked = AllReduceSync(comm_hook=make_comm_hook("onebit"))
    averager = CodecAverager("qsgd", levels=7)
    flat = AllReduceSync(use_ddp=False, averager=averager)
    for name, sync in (("onebit_hook", hooked), ("qsgd_averager", flat)):
        model = sync.prepare(_tiny_model())
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(5):
            x = xs[step]
            loss = ((model(x).squeeze(1) - x @ w_true) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            sync.after_backward(step)
            opt.step()
            sync.after_step(step)
        source = hooked.comm_hook[0] if name == "onebit_hook" else averager
        result[name] = {"bytes_sent": sync.stats.bytes_sent, "wire_bytes": source.wire_bytes,
                        "params": torch.cat([p.detach().reshape(-1)
                                             for p in model.parameters()]).numpy().copy()}
        sync.close()
    return result


@pytest.fixture(scope="module")
def hook_ranks() -> list[dict]:
    return run_local_ranks(_hook_rank, 2, timeout_s=120)


@pytest.mark.parametrize("name", [*HOOK_NAMES, "int8+zstd"])
def test_hook_trains_and_ranks_agree(hook_ranks, name):
    r0, r1 = hook_ranks[0][name], hook_ranks[1][name]
    assert np.array_equal(r0["params"], r1["params"])
    assert np.mean(r0["losses"][-5:]) < 0.5 * np.mean(r0["losses"][:5]), r0["losses"]
    assert r0["stats"]["steps"] == HOOK_STEPS
    assert r0["stats"]["raw_bytes"] > 0


def test_hooks_send_fewer_bytes_than_fp32(hook_ranks):
    stats = {name: hook_ranks[0][name]["stats"] for name in HOOK_NAMES}
    assert stats["none"]["ratio"] == 1.0
    assert stats["fp16"]["ratio"] == 2.0
    assert stats["onebit"]["ratio"] > 10
    assert stats["dct"]["ratio"] > 2  # 10% kept, 6 bytes a pair, buckets are tiny
    assert stats["qsgd"]["ratio"] > 4
    assert stats["adaquant"]["ratio"] > 4
    assert stats["powersgd"]["wire_bytes"] < stats["none"]["wire_bytes"]


def test_codec_averager_gives_the_same_mean_everywhere(hook_ranks):
    a0, a1 = hook_ranks[0]["averager"], hook_ranks[1]["averager"]
    assert np.array_equal(a0, a1)
    exact = (hook_ranks[0]["averager_input"] + hook_ranks[1]["averager_input"]) / 2
    kept = a0 != 0
    assert 0.15 < kept.mean() < 0.45  # the union of two 20% sets
    assert np.corrcoef(a0, exact)[0, 1] > 0.7


@pytest.mark.parametrize("name", ["onebit_hook", "qsgd_averager"])
def test_plugs_into_allreduce_sync(hook_ranks, name):
    r0, r1 = hook_ranks[0]["sync"][name], hook_ranks[1]["sync"][name]
    assert np.array_equal(r0["params"], r1["params"])
    assert r0["bytes_sent"] == r0["wire_bytes"] > 0
