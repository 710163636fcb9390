"""Each server-side optimizer against a plain per-row numpy reference, duplicates summed."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.errors import ConfigError
from services.ps.store import EmbeddingTable
from services.ps.tables import OptimizerConfig, TableConfig


class Reference:
    """The textbook update of one row at a time (float64), state in dicts."""

    def __init__(self, cfg: OptimizerConfig, initial: dict[int, np.ndarray]) -> None:
        self.cfg = cfg
        self.w = {i: r.astype(np.float64) for i, r in initial.items()}
        self.s: dict[int, dict] = {}

    def push(self, ids: np.ndarray, grads: np.ndarray) -> None:
        summed: dict[int, np.ndarray] = {}
        for i, g in zip(ids.tolist(), grads.astype(np.float64), strict=True):
            summed[i] = summed.get(i, 0.0) + g
        for i, g in summed.items():
            self.w[i] = self.step(i, self.w[i], g)

    def step(self, i: int, w: np.ndarray, g: np.ndarray) -> np.ndarray:
        c = self.cfg
        st = self.s.setdefault(i, {})
        g = g + c.weight_decay * w  # L2, on the rows a push touches
        if c.kind == "sgd":
            w = w - c.lr * g
        elif c.kind == "adagrad":
            st["a"] = st.get("a", c.initial_accumulator) + g * g
            w = w - c.lr * g / (np.sqrt(st["a"]) + c.eps)
        elif c.kind == "rowwise_adagrad":  # one accumulator per row: the mean square
            st["a"] = st.get("a", c.initial_accumulator) + np.mean(g * g)
            w = w - c.lr * g / (np.sqrt(st["a"]) + c.eps)
        elif c.kind == "adam":
            st["t"] = st.get("t", 0) + 1
            st["m"] = c.beta1 * st.get("m", 0.0) + (1 - c.beta1) * g
            st["v"] = c.beta2 * st.get("v", 0.0) + (1 - c.beta2) * g * g
            mhat = st["m"] / (1 - c.beta1 ** st["t"])
            vhat = st["v"] / (1 - c.beta2 ** st["t"])
            w = w - c.lr * mhat / (np.sqrt(vhat) + c.eps)
        else:  # FTRL-Proximal; z starts where the weight formula gives the initial row
            alpha, beta, l1, l2 = c.lr, c.ftrl_beta, c.ftrl_l1, c.ftrl_l2
            if "z" not in st:
                st["n"] = np.zeros_like(w)
                st["z"] = -(w * (beta / alpha + l2) + np.sign(w) * l1)
            n_new = st["n"] + g * g
            sigma = (np.sqrt(n_new) - np.sqrt(st["n"])) / alpha
            st["z"] = st["z"] + g - sigma * w
            st["n"] = n_new
            z = st["z"]
            w = np.where(np.abs(z) <= l1, 0.0,
                         -(z - np.sign(z) * l1) / ((beta + np.sqrt(n_new)) / alpha + l2))
        if c.weight_bound is not None:
            w = np.clip(w, -c.weight_bound, c.weight_bound)
        return w


CONFIGS = [
    OptimizerConfig(kind="sgd", lr=0.3),
    OptimizerConfig(kind="adagrad", lr=0.2, initial_accumulator=0.1),
    OptimizerConfig(kind="adam", lr=0.05, beta1=0.8, beta2=0.95),
    OptimizerConfig(kind="ftrl", lr=0.5, ftrl_beta=1.0, ftrl_l1=0.01, ftrl_l2=0.1),
    OptimizerConfig(kind="ftrl", lr=0.5, ftrl_l1=2.0),  # strong l1: weights snap to 0
    OptimizerConfig(kind="adagrad", lr=1.0, weight_bound=0.05),
    OptimizerConfig(kind="rowwise_adagrad", lr=0.2, initial_accumulator=0.1),
    OptimizerConfig(kind="rowwise_adagrad", lr=0.2, weight_decay=0.3),
    OptimizerConfig(kind="sgd", lr=0.3, weight_decay=0.5),
    OptimizerConfig(kind="adagrad", lr=0.2, weight_decay=0.2),
    OptimizerConfig(kind="adam", lr=0.05, weight_decay=0.1),
]


@pytest.mark.parametrize("opt", CONFIGS, ids=lambda c: f"{c.kind}")
def test_optimizer_matches_per_row_reference(opt):
    dim = 5
    table = EmbeddingTable(TableConfig(name="t", dim=dim, seed=2, init_low=-0.5, init_high=0.5,
                                       optimizer=opt))
    rng = np.random.default_rng(1)
    universe = np.arange(10, 40, dtype=np.uint64)
    ref = Reference(opt, dict(zip(universe.tolist(), table.initial_rows(universe),
                                  strict=True)))
    for step in range(4):
        # duplicates on purpose, and rows touched in some steps only (lazy Adam)
        ids = rng.choice(universe[: 10 + 6 * step], size=25).astype(np.uint64)
        grads = rng.normal(size=(ids.size, dim)).astype(np.float32)
        result = table.push(ids, grads)
        assert result.applied == np.unique(ids).size
        ref.push(ids, grads)
        rows, _ = table.peek(universe)
        expected = np.stack([ref.w[i] for i in universe.tolist()])
        np.testing.assert_allclose(rows, expected, rtol=2e-5, atol=2e-6)
    if opt.weight_bound is not None:  # every pushed row is clipped, the others are initial
        pushed, present = table.peek(universe)
        assert np.abs(pushed[present]).max() <= opt.weight_bound
        assert np.abs(pushed[~present]).max() > opt.weight_bound


def test_duplicates_are_summed_before_the_update():
    # adagrad is not linear in g: one push of (g1, g2) for one id must equal a push of g1+g2
    opt = OptimizerConfig(kind="adagrad", lr=0.1)
    a = EmbeddingTable(TableConfig(name="t", dim=3, optimizer=opt))
    b = EmbeddingTable(TableConfig(name="t", dim=3, optimizer=opt))
    g = np.array([[1, 2, 3], [0.5, -1, 4]], dtype=np.float32)
    a.push(np.array([7, 7], dtype=np.uint64), g)
    b.push(np.array([7], dtype=np.uint64), g.sum(axis=0, keepdims=True))
    assert a.content_digest() == b.content_digest()
    c = EmbeddingTable(TableConfig(name="t", dim=3, optimizer=opt))
    c.push(np.array([7], dtype=np.uint64), g[:1])
    c.push(np.array([7], dtype=np.uint64), g[1:])
    assert c.content_digest() != a.content_digest()


def test_ftrl_and_every_kind_start_from_the_initial_row():
    ids = np.arange(50, dtype=np.uint64)
    for kind in ("sgd", "adagrad", "rowwise_adagrad", "adam", "ftrl"):
        table = EmbeddingTable(TableConfig(name="t", dim=4, initializer="normal", init_std=0.3,
                                           optimizer=OptimizerConfig(kind=kind)))
        zeros = np.zeros((ids.size, 4), dtype=np.float32)
        table.push(ids, zeros)  # a zero gradient creates the rows and moves nothing
        rows, present = table.peek(ids)
        assert present.all()
        np.testing.assert_allclose(rows, table.initial_rows(ids), rtol=1e-6, atol=1e-7)


def test_set_optimizer_changes_lr_and_keeps_state():
    opt = OptimizerConfig(kind="adagrad", lr=0.1)
    table = EmbeddingTable(TableConfig(name="t", dim=2, init_low=0.0, init_high=0.0,
                                       optimizer=opt))
    ids = np.array([1], dtype=np.uint64)
    table.push(ids, np.array([[3.0, 4.0]], dtype=np.float32))
    before = table.peek(ids)[0]
    new = table.set_optimizer(lr=1.0)
    assert new.lr == 1.0 and table.config.optimizer.lr == 1.0
    table.push(ids, np.array([[4.0, 3.0]], dtype=np.float32))
    # accumulator kept: 9+16 and 16+9 -> sqrt = 5 for both columns
    np.testing.assert_allclose(table.peek(ids)[0], before - np.array([[0.8, 0.6]]), rtol=1e-6)
    with pytest.raises(ConfigError, match="lr"):
        table.set_optimizer(lr=-1.0)
    with pytest.raises(ConfigError, match="kind"):
        table.set_optimizer(kind="adam")
    with pytest.raises(ConfigError):
        table.set_optimizer(momentum=0.9)
    assert table.config.optimizer.lr == 1.0


def _two_updates(opt: OptimizerConfig, first: list[float], second: list[float]) -> np.ndarray:
    """A zero-initialised row's value after two pushes (rows ``first`` then ``second``)."""
    table = EmbeddingTable(TableConfig(name="t", dim=len(first), initializer="zeros",
                                       optimizer=opt))
    one = np.array([3], dtype=np.uint64)
    out = []
    for g in (first, second):
        table.push(one, np.array([g], dtype=np.float32))
        out.append(table.peek(one)[0][0].copy())
    return np.stack(out)


def test_adagrad_first_steps_are_pinned():
    # no initial accumulator: the first step of an element is -lr·sign(g) whatever |g| is
    got = _two_updates(OptimizerConfig(kind="adagrad", lr=0.1, eps=1e-12), [4.0, -0.01],
                       [3.0, 0.0])
    np.testing.assert_allclose(got[0], [-0.1, 0.1], rtol=1e-5)
    np.testing.assert_allclose(got[1], [-0.1 - 0.1 * 3 / 5, 0.1], rtol=1e-5)  # sqrt(16+9)
    # an initial accumulator of 9 scales the first step by |g| / sqrt(9 + g²)
    got = _two_updates(OptimizerConfig(kind="adagrad", lr=0.1, eps=1e-12,
                                       initial_accumulator=9.0), [4.0, 0.0], [0.0, 0.0])
    np.testing.assert_allclose(got[0], [-0.1 * 4 / 5, 0.0], rtol=1e-5)


def test_rowwise_adagrad_first_steps_are_pinned():
    # one accumulator per row: mean(g²) = (9 + 16) / 2 = 12.5 for g = (3, 4)
    got = _two_updates(OptimizerConfig(kind="rowwise_adagrad", lr=0.5, eps=1e-12,
                                       initial_accumulator=0.0), [3.0, 4.0], [1.0, 1.0])
    np.testing.assert_allclose(got[0], [-0.5 * 3 / 12.5 ** 0.5, -0.5 * 4 / 12.5 ** 0.5],
                               rtol=1e-5)
    step2 = 0.5 / 13.5 ** 0.5  # 12.5 + mean(1, 1)
    np.testing.assert_allclose(got[1], got[0] - step2, rtol=1e-5)
    # a per-element Adagrad would move the two elements by the same first step: not row-wise
    assert not np.isclose(got[0][0], got[0][1])


def test_adam_bias_correction_is_per_row_and_weight_decay_is_l2():
    # with bias correction the first Adam step is -lr·sign(g) (m̂ = g, v̂ = g²)
    got = _two_updates(OptimizerConfig(kind="adam", lr=0.01, eps=1e-12), [5.0, -0.2],
                       [5.0, -0.2])
    np.testing.assert_allclose(got[0], [-0.01, 0.01], rtol=1e-4)
    np.testing.assert_allclose(got[1], [-0.02, 0.02], rtol=1e-4)  # same g: same step again
    # SGD with weight decay 0.5, lr 0.1 on a row at 0 then at -0.1: g + 0.5·w
    got = _two_updates(OptimizerConfig(kind="sgd", lr=0.1, weight_decay=0.5), [1.0], [0.0])
    np.testing.assert_allclose(got[:, 0], [-0.1, -0.1 - 0.1 * 0.5 * -0.1], rtol=1e-5)


def test_weight_decay_is_refused_where_it_does_not_apply():
    with pytest.raises(ConfigError, match="ftrl_l2"):
        OptimizerConfig(kind="ftrl", weight_decay=0.1)
    with pytest.raises(ConfigError, match="weight_decay"):
        OptimizerConfig(kind="adagrad", weight_decay=-1.0)
