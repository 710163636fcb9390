"""Dense-side compression without a process group: hook factory, optimizers' checks, 1 rank."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from services.common.errors import ConfigError, InvalidArgument
from services.worker.compression import (
    HOOK_NAMES,
    CodecAverager,
    OnebitAdam,
    OnebitLamb,
    OnebitReducer,
    compressed_allreduce,
    make_comm_hook,
    padded_size,
)
from services.worker.compression.hooks import PowerSGDHookState


@pytest.mark.parametrize("name", [*HOOK_NAMES, "int8", "dct+zstd"])
def test_every_hook_name_builds(name):
    state, hook = make_comm_hook(name)
    assert callable(hook) and state.wire_bytes == 0
    assert state.stats.as_dict()["ratio"] == 1.0


@pytest.mark.parametrize("name", ["gzip", "fp8", "", "zstd", "powerSGD"])
def test_unknown_hook_names_are_refused(name):
    with pytest.raises(InvalidArgument, match="unknown"):
        make_comm_hook(name)


@pytest.mark.parametrize(("name", "params"), [
    ("dct", {"keep": 0.0}), ("qsgd", {"levels": -1}), ("onebit", {"chunk": 5}),
    ("powersgd", {"rank": 2}), ("fp16", {"levels": 3}), ("topk", {"nope": 1}),
])
def test_bad_hook_params_are_refused(name, params):
    with pytest.raises(InvalidArgument):
        make_comm_hook(name, **params)


def test_powersgd_defaults_are_the_baseline_settings():
    state, _ = make_comm_hook("powersgd")
    assert isinstance(state, PowerSGDHookState)
    assert state.matrix_approximation_rank == 1 and state.start_powerSGD_iter == 2


def test_single_rank_allreduce_validates_buffers_and_telescopes():
    x = [torch.randn(50) for _ in range(5)]
    size = padded_size(50, 1)
    assert size == 56
    with pytest.raises(InvalidArgument, match="error buffers"):
        compressed_allreduce(x[0], torch.zeros(50), torch.zeros(50))
    ew, es = torch.zeros(size), torch.zeros(size)
    total = sum(compressed_allreduce(v, ew, es) for v in x)
    np.testing.assert_allclose(total.numpy(), (sum(x) - ew[:50] - es[:50]).numpy(), atol=1e-5)


def test_reducer_counts_bytes_and_restarts_on_resize():
    reducer = OnebitReducer()
    reducer.allreduce(torch.randn(1000), key="a")
    assert reducer.stats.wire_bytes == 1000 // 8 + 4 + 1000 // 8 + 4
    assert reducer.errors("a")[0].numel() == 1000
    reducer.allreduce(torch.randn(2000), key="a")
    assert reducer.errors("a")[0].numel() == 2000
    reducer.reset()
    assert reducer.errors("a") is None


def test_codec_averager_single_rank_is_the_codec_round_trip():
    avg = CodecAverager("topk", keep=0.1)
    x = torch.randn(20, 10)
    out = avg(x, None, 1)
    assert out.shape == x.shape and int((out != 0).sum()) == 20
    assert avg.report_loss(1.0) is None
    with pytest.raises(InvalidArgument):
        CodecAverager(avg.codec, keep=0.5)


def test_onebit_adam_warmup_equals_torch_adam():
    torch.manual_seed(0)
    a, b = torch.randn(32, 6), torch.randn(32)
    ours, ref = nn.Parameter(torch.zeros(6)), nn.Parameter(torch.zeros(6))
    opt = OnebitAdam([ours], lr=0.01, freeze_step=20)
    adam = torch.optim.Adam([ref], lr=0.01)
    for _ in range(20):
        for p, o in ((ours, opt), (ref, adam)):
            o.zero_grad()
            ((a @ p - b) ** 2).mean().backward()
            o.step()
    torch.testing.assert_close(ours, ref)
    assert opt.step_count == 20 and opt.compressing
    assert opt.stats.wire_bytes == opt.stats.raw_bytes == 20 * 6 * 4


@pytest.mark.parametrize("cls", [OnebitAdam, OnebitLamb])
def test_optimizers_refuse_embeddings(cls):
    model = nn.ModuleDict({"emb": nn.EmbeddingBag(10, 4), "mlp": nn.Linear(4, 1)})
    with pytest.raises(ConfigError, match="emb.*zero variance"):
        cls(model)
    dense = cls(nn.Sequential(nn.Linear(4, 2)))  # a dense module is fine
    assert len(dense.param_groups[0]["params"]) == 2


@pytest.mark.parametrize("cls", [OnebitAdam, OnebitLamb])
def test_optimizers_refuse_sparse_gradients_without_moving(cls):
    emb = nn.Embedding(10, 3, sparse=True)
    opt = cls(emb.parameters(), lr=0.1, freeze_step=2)
    before = emb.weight.detach().clone()
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(InvalidArgument, match="sparse"):
        opt.step()
    assert torch.equal(emb.weight, before) and opt.step_count == 0


@pytest.mark.parametrize(("cls", "kwargs"), [
    (OnebitAdam, {"freeze_step": 0}), (OnebitAdam, {"lr": -1.0}), (OnebitAdam, {"eps": 0.0}),
    (OnebitAdam, {"betas": (1.0, 0.9)}), (OnebitLamb, {"factor_min": 2.0}),
    (OnebitLamb, {"factor_max": 0.5}), (OnebitLamb, {"factor_threshold": 1.5}),
    (OnebitLamb, {"min_coeff": 20.0}), (OnebitAdam, {"variance_floor": -0.1}),
    (OnebitLamb, {"variance_floor": 2.0}),
])
def test_optimizer_config_is_validated(cls, kwargs):
    with pytest.raises(ConfigError):
        cls([nn.Parameter(torch.zeros(3))], **kwargs)


def test_load_state_dict_resets_error_buffers_and_keeps_step():
    p = nn.Parameter(torch.ones(8))
    opt = OnebitAdam([p], lr=0.1, freeze_step=2)
    for _ in range(4):
        opt.zero_grad()
        (p ** 2).sum().backward()
        opt.step()
    assert opt.reducer.errors("momentum") is not None
    saved = opt.state_dict()
    fresh = OnebitAdam([p], lr=0.1, freeze_step=2)
    fresh.reducer.allreduce(torch.ones(8), key="momentum")
    fresh.load_state_dict(saved)
    assert fresh.step_count == 4 and fresh.compressing
    assert fresh.reducer.errors("momentum") is None


def test_lamb_compression_stage_bounds_its_factor_single_rank():
    torch.manual_seed(1)
    a, b = torch.randn(64, 12), torch.randn(64)
    x = nn.Parameter(torch.randn(12))
    opt = OnebitLamb([x], lr=0.01, freeze_step=5, betas=(0.9, 0.99))
    factors = []
    for _ in range(40):
        opt.zero_grad()
        ((a @ x - b) ** 2).mean().backward()
        opt.step()
        factors.extend(opt.last_factors if opt.step_count > 5 else [])
    f = np.array([1.0, *factors])
    assert len(factors) == 35
    assert f.min() >= 0.5 and f.max() <= 4 and np.abs(f[1:] / f[:-1] - 1).max() <= 0.1 + 1e-9


@pytest.mark.parametrize("cls", [OnebitAdam, OnebitLamb])
def test_variance_floor_bounds_coordinates_quiet_during_warmup(cls):
    """A coordinate with no gradient in warm-up (v = 0) gets ±RMS from sign compression
    afterwards: without the floor it jumps by lr·RMS/eps; with it by at most ~10·lr."""
    def largest_weight(floor: float) -> float:
        p = nn.Parameter(torch.full((64,), 0.5))
        opt = cls([p], lr=0.01, freeze_step=3, variance_floor=floor)
        for step in range(6):
            g = torch.linspace(0.5, 1.5, 64)
            g[0] = 0.0 if step < 3 else 1.0
            p.grad = g
            opt.step()
        return float(p.detach().abs().max())

    assert largest_weight(0.0) > 100
    assert largest_weight(0.01) < 2.0
