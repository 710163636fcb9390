"""Models: shapes, gradients, the interaction formulas against naive loops, config errors."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from services.common.config import from_dict
from services.common.errors import ConfigError, InvalidArgument
from services.worker import kernels
from services.worker.kernels import PooledFrom
from services.worker.models import (
    DLRM,
    MODELS,
    CrossLayerV2,
    DCNv2,
    DenseNorm,
    ModelConfig,
    build_model,
    dot_interaction,
    fm_second_order,
    pick_device,
)
from services.worker.pooling import PooledFeatures
from tests.numba_signatures import signatures

DIMS = {"user": 8, "item": 8, "cat": 4}


def _inputs(batch: int = 6, num_dense: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    pooled = {k: torch.randn(batch, d, generator=g, requires_grad=True) for k, d in DIMS.items()}
    return pooled, torch.randn(batch, num_dense, generator=g)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("num_dense", [0, 3])
def test_forward_shape_and_every_parameter_gets_a_gradient(name: str, num_dense: int) -> None:
    torch.manual_seed(0)
    model = build_model(name, sparse_dims=DIMS, num_dense=num_dense)
    pooled, dense = _inputs(num_dense=num_dense)
    logits = model(pooled, dense)
    assert logits.shape == (6,)
    assert torch.isfinite(logits).all()
    logits.sum().backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, pname
    for fname, t in pooled.items():
        assert t.grad is not None and t.grad.abs().sum() > 0, fname


@pytest.mark.parametrize("name", sorted(MODELS))
def test_same_seed_same_model_and_extra_keys_ignored(name: str) -> None:
    torch.manual_seed(3)
    a = build_model(name, sparse_dims=DIMS, num_dense=3)
    torch.manual_seed(3)
    b = build_model(name, sparse_dims=DIMS, num_dense=3)
    pooled, dense = _inputs()
    extra = dict(pooled, unused=torch.zeros(6, 2))
    assert torch.equal(a(pooled, dense), b(extra, dense))


@pytest.mark.parametrize("name", sorted(set(MODELS) - {"lr"}))  # lr: linear, no products
def test_models_learn_a_planted_signal(name: str) -> None:
    torch.manual_seed(1)
    model = build_model(name, sparse_dims=DIMS, num_dense=3)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    pooled, dense = _inputs(batch=128, seed=5)
    pooled = {k: v.detach() for k, v in pooled.items()}
    labels = ((pooled["user"] * pooled["item"]).sum(1) + dense[:, 0] > 0).float()
    loss_fn = torch.nn.BCEWithLogitsLoss()
    first = loss_fn(model(pooled, dense), labels).item()
    for _ in range(60):
        opt.zero_grad()
        loss = loss_fn(model(pooled, dense), labels)
        loss.backward()
        opt.step()
    assert loss.item() < 0.7 * first


@pytest.mark.parametrize("keep_first", [False, True])
def test_dot_interaction_matches_pairwise_loop(keep_first: bool) -> None:
    vecs = list(torch.randn(5, 3, 4).unbind(0))  # 5 vectors, batch 3, dim 4
    z = dot_interaction(vecs, keep_first=keep_first)
    pairs = [(i, j) for i in range(5) for j in range(i)]  # tril_indices(5, 5, -1) order
    dots = torch.stack([torch.stack([vecs[i][b] @ vecs[j][b] for i, j in pairs])
                        for b in range(3)])
    expected = torch.cat([vecs[0], dots], dim=1) if keep_first else dots
    torch.testing.assert_close(z, expected)


@pytest.mark.parametrize("keep_first", [False, True])
@pytest.mark.parametrize("shape", [(1, 2, 1), (7, 5, 3), (64, 27, 16), (150, 6, 5), (70, 4, 40)])
def test_interaction_kernel_matches_bmm_forward_and_backward(
        shape: tuple[int, int, int], keep_first: bool) -> None:
    """The CPU float32 kernel against torch's bmm path (taken for float64): values and the
    gradient w.r.t. every vector, also for non-contiguous inputs."""
    batch, n, dim = shape
    g = torch.Generator().manual_seed(sum(shape))
    wide = torch.randn(n, batch, 2 * dim, generator=g, dtype=torch.float64)
    width = (dim if keep_first else 0) + n * (n - 1) // 2
    upstream = torch.randn(batch, width, generator=g, dtype=torch.float64)
    v64 = [w[:, :dim].clone().requires_grad_(True) for w in wide]
    v32 = [w.float()[:, :dim].requires_grad_(True) for w in wide]  # strided leaves
    assert batch == 1 or not v32[0].is_contiguous()
    z64 = dot_interaction(v64, keep_first=keep_first)
    z32 = dot_interaction(v32, keep_first=keep_first)
    (z64 * upstream).sum().backward()
    (z32 * upstream.float()).sum().backward()
    torch.testing.assert_close(z32.double(), z64.detach(), rtol=1e-5, atol=1e-5)
    for a, b in zip(v32, v64, strict=True):
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("keep_first", [False, True])
@pytest.mark.parametrize("batch", [1, 70, 128])
def test_interaction_kernel_gradient_through_a_linear_layer(batch: int, keep_first: bool) -> None:
    """Under a Linear layer (as DLRM's top MLP) the upstream gradient comes back in the
    output's feature-major order, not row-major: the kernel's values and gradients still
    match bmm's (float64), and the output is the dots, not their transpose."""
    n, dim = 6, 5
    g = torch.Generator().manual_seed(batch)
    base = torch.randn(n, batch, dim, generator=g, dtype=torch.float64)
    width = (dim if keep_first else 0) + n * (n - 1) // 2
    weight = torch.randn(3, width, generator=g, dtype=torch.float64)
    v64 = [b.clone().requires_grad_(True) for b in base]
    v32 = [b.float().requires_grad_(True) for b in base]
    z32 = dot_interaction(v32, keep_first=keep_first)
    assert z32.shape == (batch, width)
    y64 = torch.nn.functional.linear(dot_interaction(v64, keep_first=keep_first), weight)
    y32 = torch.nn.functional.linear(z32, weight.float())
    torch.testing.assert_close(y32.double(), y64.detach(), rtol=1e-5, atol=1e-5)
    y64.pow(2).sum().backward()
    y32.pow(2).sum().backward()
    for a, b in zip(v32, v64, strict=True):
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-4, atol=1e-4)


def _bags(g: torch.Generator, parts: int, batch: int, num_rows: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids (into ``num_rows`` rows) and bag offsets of ``parts x batch`` bags of 0 to 3 ids."""
    sizes = torch.randint(0, 4, (parts * batch,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)[:-1]])
    return torch.randint(0, num_rows, (int(sizes.sum()),), generator=g), offsets


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("batch", [5, 70])
def test_interaction_of_pooled_vectors_sends_their_gradients_to_the_rows(
        mode: str, batch: int) -> None:
    """Vectors that the pooling kernel gave (two calls, one of several features) take their
    gradients straight into the calls' rows, next to plain vectors in any order: the rows'
    and the plain vectors' gradients match float64 (embedding_bag and bmm), also where a
    pooled vector is used twice and where another use of it adds its own gradient."""
    dim = 4
    g = torch.Generator().manual_seed(batch)
    rows = [torch.randn(9, dim, generator=g, dtype=torch.float64),
            torch.randn(6, dim, generator=g, dtype=torch.float64)]
    bags = [_bags(g, 3, batch, 9), _bags(g, 1, batch, 6)]
    dense = [torch.randn(batch, dim, generator=g, dtype=torch.float64) for _ in range(2)]

    def run(dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        leaves = [r.to(dtype).requires_grad_(True) for r in rows]
        plain = [d.to(dtype).requires_grad_(True) for d in dense]
        pooled = PooledFeatures()
        pooled.pool(["a0", "a1", "a2"], leaves[0], *bags[0], mode)
        pooled.pool(["b"], leaves[1], *bags[1], mode)
        names = ["x0", "a2", "b", "a0", "x1", "a2"]  # a1 unused, a2 twice
        vecs = [plain[0], pooled["a2"], pooled["b"], pooled["a0"], plain[1], pooled["a2"]]
        sources = [pooled.source_of(n, v) for n, v in zip(names, vecs, strict=True)]
        z = dot_interaction(vecs, keep_first=True, sources=sources)
        weight = torch.linspace(-1, 1, z.shape[1], dtype=dtype)
        loss = (z * weight).pow(2).sum() + pooled["a0"].sum() * 0.5  # a0 also used elsewhere
        loss.backward()
        return z, [r.grad for r in leaves], [p.grad for p in plain]

    z32, rows32, plain32 = run(torch.float32)
    z64, rows64, plain64 = run(torch.float64)
    torch.testing.assert_close(z32.double(), z64.detach(), rtol=1e-5, atol=1e-5)
    for a32, a64 in zip(rows32 + plain32, rows64 + plain64, strict=True):
        torch.testing.assert_close(a32.double(), a64, rtol=1e-4, atol=1e-4)


def _graph_inputs(z: torch.Tensor) -> list[object]:
    """What the interaction's node hangs on: a leaf's tensor, or another node."""
    return [getattr(fn, "variable", fn) for fn, _ in z.grad_fn.next_functions if fn is not None]


def test_interaction_takes_the_pooled_rows_as_its_inputs() -> None:
    """Given their sources, the kernel's node hangs on the pooled rows (no pass of the
    pooling's backward) and on the plain vectors; without sources, or without autograd, it
    takes every vector as it is."""
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(8, 4, generator=g, requires_grad=True)
    first = torch.randn(6, 4, generator=g, requires_grad=True)
    pooled = PooledFeatures()
    pooled.pool(["a", "b"], rows, *_bags(g, 2, 6, 8), "sum")
    vecs = [first, pooled["a"], pooled["b"]]
    sources = [None, pooled.source_of("a", pooled["a"]), pooled.source_of("b", pooled["b"])]
    z = dot_interaction(vecs, keep_first=True, sources=sources)
    inputs = _graph_inputs(z)
    assert len(inputs) == 2 and inputs[0] is first and inputs[1] is rows
    plain = dot_interaction(vecs, keep_first=True)
    assert [type(fn).__name__ for fn in _graph_inputs(plain)[1:]] == ["PoolBagsBackward"] * 2
    torch.testing.assert_close(plain, z)
    with torch.no_grad():
        torch.testing.assert_close(dot_interaction(vecs, keep_first=True, sources=sources), z)
    with pytest.raises(ValueError, match=r"sources\[1\]: a \(6, 4\) vector cannot be part 2"):
        dot_interaction(vecs, keep_first=True, sources=[None, PooledFrom(sources[1].bags, 2),
                                                        None])


def _backward_nodes(t: torch.Tensor) -> set[str]:
    """The kinds of autograd node that ``t``'s graph holds."""
    seen, todo = set(), [t.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is not None and fn not in seen:
            seen.add(fn)
            todo.extend(f for f, _ in fn.next_functions)
    return {type(fn).__name__ for fn in seen}


def _dlrm_grads(inputs) -> tuple[set[str], list[torch.Tensor]]:
    """A DLRM step over three features pooled from one rows tensor (one PoolBags call), the
    model's input made by ``inputs`` from the :class:`PooledFeatures`: the loss's backward
    node kinds, and the rows' then every parameter's gradient."""
    g = torch.Generator().manual_seed(5)
    rows = torch.randn(11, 4, generator=g, requires_grad=True)
    pooled = PooledFeatures()
    pooled.pool(["a", "b", "c"], rows, *_bags(g, 3, 70, 11), "mean")
    dense = torch.randn(70, 2, generator=g)
    torch.manual_seed(0)
    model = DLRM(sparse_dims={"a": 4, "b": 4, "c": 4}, num_dense=2, bottom_mlp=[8, 4],
                 top_mlp=[5])
    loss = model(inputs(pooled), dense).pow(2).sum()
    loss.backward()
    return _backward_nodes(loss), [rows.grad, *(p.grad for p in model.parameters())]


def test_dlrm_given_pool_batch_features_sends_the_same_gradients_straight_to_the_rows() -> None:
    """DLRM over a PooledFeatures takes its vectors' gradients into the rows with no pass of
    the pooling's backward, and every gradient equals the plain path's (the same tensors
    in a plain dict)."""
    fused_nodes, fused = _dlrm_grads(lambda pooled: pooled)
    plain_nodes, plain = _dlrm_grads(dict)
    assert "PoolBagsBackward" not in fused_nodes and "PoolBagsBackward" in plain_nodes
    for a, b in zip(fused, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_dlrm_takes_a_transformed_pooled_tensor_as_plain() -> None:
    """A pooled feature replaced by a function of it (as the DCT-MP sparsifier does) is no
    output of the pooling call: its gradient goes through autograd (the 0.5 included) to the
    rows, equal to the plain path's."""

    def scaled(pooled: PooledFeatures) -> PooledFeatures:
        pooled["b"] = pooled["b"] * 0.5
        return pooled

    nodes, fused = _dlrm_grads(scaled)
    _, plain = _dlrm_grads(lambda pooled: dict(scaled(pooled)))
    assert "PoolBagsBackward" in nodes
    for a, b in zip(fused, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_fm_second_order_matches_pairwise_sum() -> None:
    v = torch.randn(4, 6, 3, dtype=torch.float64)
    expected = torch.stack([
        sum((v[b, i] * v[b, j]).sum() for i, j in itertools.combinations(range(6), 2))
        for b in range(4)])
    torch.testing.assert_close(fm_second_order(v), expected)


@pytest.mark.parametrize("rank", [None, 2])
def test_cross_layer_formula(rank: int | None) -> None:
    layer = CrossLayerV2(5, rank)
    x0, x = torch.randn(2, 5), torch.randn(2, 5)
    if rank is None:
        w = layer.w.weight @ x.T + layer.w.bias[:, None]
    else:
        w = layer.w[1].weight @ (layer.w[0].weight @ x.T) + layer.w[1].bias[:, None]
    torch.testing.assert_close(layer(x0, x), x0 * w.T + x)


def test_dcn_parallel_and_low_rank() -> None:
    model = DCNv2(sparse_dims=DIMS, num_dense=3, structure="parallel", cross_rank=2,
                  cross_layers=2)
    pooled, dense = _inputs()
    assert model(pooled, dense).shape == (6,)
    assert model.head.in_features == sum(DIMS.values()) + 3 + 64


def test_bad_inputs_are_clear_errors() -> None:
    model = build_model("dlrm", sparse_dims=DIMS, num_dense=3)
    pooled, dense = _inputs()
    with pytest.raises(InvalidArgument, match="'cat' is missing"):
        model({k: v for k, v in pooled.items() if k != "cat"}, dense)
    with pytest.raises(InvalidArgument, match="pooled\\['user'\\] must be \\(6, 8\\)"):
        model(dict(pooled, user=torch.zeros(6, 7)), dense)
    with pytest.raises(InvalidArgument, match="dense must be"):
        model(pooled, torch.zeros(6, 2))


@pytest.mark.parametrize("kwargs, match", [
    ({"sparse_dims": {}, "num_dense": 1}, "at least one sparse feature"),
    ({"sparse_dims": {"a": 0}, "num_dense": 1}, "an int >= 1"),
    ({"sparse_dims": {"a": 4}, "num_dense": -1}, "num_dense"),
    ({"sparse_dims": {"a": 4}, "num_dense": 1, "bottom_mlp": []}, "at least one layer"),
    ({"sparse_dims": {"a": 4}, "num_dense": 1, "top_mlp": [8, 0]}, "positive layer sizes"),
])
def test_bad_dlrm_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build_model("dlrm", **kwargs)


def test_build_model_errors() -> None:
    with pytest.raises(ConfigError, match="unknown model 'nope'"):
        build_model("nope", sparse_dims=DIMS, num_dense=1)
    with pytest.raises(ConfigError, match="does not take \\['cross_layers'\\]"):
        build_model("dlrm", sparse_dims=DIMS, num_dense=1, cross_layers=2)
    with pytest.raises(ConfigError, match="structure"):
        build_model("dcnv2", sparse_dims=DIMS, num_dense=1, structure="diagonal")


def test_model_config_from_dict_builds_and_rejects() -> None:
    cfg = from_dict(ModelConfig, {"name": "deepfm", "deep_mlp": [16, 8], "fm_dim": 4})
    assert cfg.arch() == {"deep_mlp": [16, 8], "fm_dim": 4, "id_weights": False,
                          "dense_norm": False}
    model = cfg.build(sparse_dims=DIMS, num_dense=2)
    pooled, _ = _inputs()
    assert model(pooled, torch.zeros(6, 2)).shape == (6,)
    with pytest.raises(ConfigError, match="unknown keys \\['hidden'\\]"):
        from_dict(ModelConfig, {"name": "dlrm", "hidden": [3]})
    with pytest.raises(ConfigError, match="unknown model"):
        ModelConfig(name="xgboost")
    with pytest.raises(ConfigError, match="cross_layers"):
        ModelConfig(cross_layers=0)


def test_pick_device() -> None:
    assert pick_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert pick_device().type == expected
    with pytest.raises(ConfigError, match="bad device"):
        pick_device("tpu-ish")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            pick_device("cuda")


@pytest.mark.parametrize("name", ["deepfm", "wide_deep"])
def test_id_weights_are_the_last_column_added_to_the_logit(name: str) -> None:
    """With id_weights, each table's last column is the id's own first-order weight: raising
    it by d raises the logit by exactly d (the FM, deep and dense parts never see it)."""
    torch.manual_seed(0)
    model = build_model(name, sparse_dims=DIMS, num_dense=3, id_weights=True)
    pooled, dense = _inputs()
    base = model(pooled, dense)
    for feature, delta in (("user", 0.75), ("cat", -2.0)):
        moved = dict(pooled)
        moved[feature] = pooled[feature].clone()
        moved[feature][:, -1] += delta
        torch.testing.assert_close(model(moved, dense), base + delta)
    # any other column moves the logit by something else
    moved = dict(pooled, user=pooled["user"].clone())
    moved["user"][:, 0] += 0.75
    assert not torch.allclose(model(moved, dense), base + 0.75)


def test_table_dim_counts_the_id_weight_column() -> None:
    assert ModelConfig(name="deepfm", id_weights=True).table_dim(16) == 17
    assert ModelConfig(name="wide_deep", id_weights=True).table_dim(16) == 17
    assert ModelConfig(name="deepfm").table_dim(16) == 16  # off by default
    assert ModelConfig(name="dlrm", id_weights=True).table_dim(16) == 16  # no first order
    with pytest.raises(ConfigError, match=">= 2"):
        build_model("deepfm", sparse_dims={"a": 1}, num_dense=0, id_weights=True)


def test_dense_norm_keeps_the_statistics_of_the_first_warmup_samples() -> None:
    """Four batches of 16 fill the warm-up of 64 samples; two later batches from another
    distribution change nothing. The buffers equal numpy's mean and variance of exactly the
    first 64 samples (a norm that keeps updating, keeps only the last batch's statistics or
    merges batches without the cross term fails this), and those samples come out
    standardised."""
    g = torch.Generator().manual_seed(0)
    first = torch.randn(64, 3, generator=g) * torch.tensor([1.0, 5.0, 0.1]) + torch.tensor(
        [2.0, -3.0, 10.0])
    later = torch.randn(32, 3, generator=g) * 50 + 100
    norm = DenseNorm(3, warmup=64)
    for chunk in (*first.split(16), *later.split(16)):
        norm(chunk)
    assert float(norm.count) == 64
    expected = first.double().numpy()
    np.testing.assert_allclose(norm.mean.numpy(), expected.mean(0), rtol=1e-12)
    np.testing.assert_allclose((norm.m2 / norm.count).numpy(), expected.var(0), rtol=1e-9)
    norm.eval()
    out = norm(first).double()
    np.testing.assert_allclose(out.mean(0).numpy(), 0.0, atol=1e-5)
    np.testing.assert_allclose(out.std(0, unbiased=False).numpy(), 1.0, rtol=1e-4)  # eps


def test_dense_norm_is_the_identity_until_trained_and_never_updates_in_eval_mode() -> None:
    norm = DenseNorm(2).eval()
    x = torch.tensor([[1.0, 2.0], [3.0, 5.0]])
    assert torch.equal(norm(x), x) and float(norm.count) == 0
    with pytest.raises(ConfigError, match="warmup"):
        DenseNorm(2, warmup=0)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_dense_norm_statistics_travel_in_the_state_dict(name: str) -> None:
    """A model rebuilt from its config and state dict (a checkpoint, a served version)
    predicts exactly as the trained one; without the state its normalisation differs."""
    cfg = ModelConfig(name=name, dense_norm=True)
    torch.manual_seed(0)
    model = cfg.build(sparse_dims=DIMS, num_dense=3)
    pooled, dense = _inputs(batch=32)
    model(pooled, dense * 7 + 4)  # training mode: the statistics are taken
    twin = cfg.build(sparse_dims=DIMS, num_dense=3)
    fresh = cfg.build(sparse_dims=DIMS, num_dense=3)
    twin.load_state_dict(model.state_dict())
    fresh.load_state_dict({k: v for k, v in model.state_dict().items() if "dense_norm" not in k},
                          strict=False)
    for m in (model, twin, fresh):
        m.eval()
    with torch.no_grad():
        assert torch.equal(model(pooled, dense), twin(pooled, dense))
        assert not torch.allclose(model(pooled, dense), fresh(pooled, dense))


def test_the_kernels_take_any_number_of_features_under_one_compiled_signature() -> None:
    """Once pooling and the interaction ran (forward, backward, pooled sources and the
    pooling's own backward) for 3 features, 5 and 9 features of the same dim add no
    signature to any kernel (compiled or loaded from numba's cache): a kernel taking one array per feature compiles
    again for each count, seconds each in every cold process."""
    def step(features: int) -> None:
        g = torch.Generator().manual_seed(features)
        rows = torch.randn(12, 4, generator=g, requires_grad=True)
        names = [f"f{k}" for k in range(features)]
        pooled = PooledFeatures()
        pooled.pool(names, rows, *_bags(g, features, 7, 12), "sum")
        dense = torch.randn(7, 4, generator=g, requires_grad=True)
        vecs = [dense, *(pooled[n] for n in names)]
        sources = [None, *(pooled.source_of(n, pooled[n]) for n in names)]
        z = dot_interaction(vecs, keep_first=True, sources=sources)
        (z.pow(2).sum() + sum(pooled[n].sum() for n in names)).backward()
        assert rows.grad is not None and dense.grad is not None

    step(3)
    before = signatures(kernels)
    step(5)
    step(9)
    assert signatures(kernels) == before


def test_vectors_of_another_shape_are_refused_before_the_kernel_reads_them() -> None:
    """A vector of another batch or dim than the first is a ValueError naming it, not a
    read past its end."""
    vecs = [torch.randn(6, 4), torch.randn(6, 4), torch.randn(5, 4)]
    with pytest.raises(ValueError, match=r"tensor 2 .*\(5, 4\).*\(6, 4\)"):
        dot_interaction(vecs, keep_first=False)
    with pytest.raises(ValueError, match=r"tensor 1 .*\(6, 3\)"):
        dot_interaction([torch.randn(6, 4), torch.randn(6, 3)], keep_first=False)
