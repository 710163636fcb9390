"""Per-table gradient clipping (``optimizer.grad_clip``) and weight clipping
(``optimizer.weight_bound``): an update with a clip equals the update of the clipped
gradient (duplicates summed first), never the raw one's, on every optimizer and on the
one-call path over several tables; it is applied before the finite check; a bad clip is a
ConfigError naming the field, and a refused change leaves the table as it was."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.errors import ConfigError
from services.ps.multitable import push_plain
from services.ps.store import EmbeddingTable
from services.ps.tables import OptimizerConfig, TableConfig

KINDS = ("sgd", "adagrad", "rowwise_adagrad", "adam", "ftrl")
CLIP = 0.5
IDS = np.array([3, 7, 7, 9], dtype=np.uint64)  # 7 twice: its gradients are summed, then clipped
GRADS = np.array([[2.0, -0.1, 0.3], [0.4, 0.2, -3.0], [0.4, 0.2, -0.1], [-0.7, 0.5, 0.05]],
                 dtype=np.float32)


def table(kind: str, lr: float = 0.1, **optimizer: float) -> EmbeddingTable:
    if kind in ("adagrad", "rowwise_adagrad"):  # the step's size follows the gradient's
        optimizer.setdefault("initial_accumulator", 1.0)
    return EmbeddingTable(TableConfig(name="t", dim=3, seed=4, init_low=-0.2, init_high=0.2,
                                      optimizer=OptimizerConfig(kind=kind, lr=lr, **optimizer)))


def rows(t: EmbeddingTable) -> np.ndarray:
    return t.peek(np.unique(IDS))[0]


@pytest.mark.parametrize("kind", KINDS)
def test_a_clipped_update_is_the_update_of_the_clipped_gradient(kind: str) -> None:
    clipped, reference, raw = table(kind, grad_clip=CLIP), table(kind), table(kind)
    summed_ids, inverse = np.unique(IDS, return_inverse=True)
    summed = np.zeros((summed_ids.size, 3), np.float32)
    np.add.at(summed, inverse, GRADS)
    for scale in (1.0, 3.0, 0.2):  # state (accumulators, moments) follows the clip too
        clipped.push(IDS, scale * GRADS)
        reference.push(summed_ids, np.clip(scale * summed, -CLIP, CLIP))
        raw.push(IDS, scale * GRADS)
    np.testing.assert_array_equal(rows(clipped), rows(reference))
    assert clipped.content_digest() == reference.content_digest()
    assert np.abs(rows(clipped) - rows(raw)).max() > 1e-3  # the raw gradient's is another


@pytest.mark.parametrize("kind", ["adagrad", "rowwise_adagrad", "sgd"])
def test_the_one_call_path_over_tables_clips_as_each_table_does(kind: str) -> None:
    """push_plain over tables of one config (Adagrads: one optimizer call for all) equals
    each table's own clipped push."""
    fused = [table(kind, grad_clip=CLIP) for _ in range(3)]
    own = [table(kind, grad_clip=CLIP) for _ in range(3)]
    for t in fused + own:
        t.lookup(np.unique(IDS))
    assert push_plain(fused, [IDS] * 3, [GRADS, 2 * GRADS, -GRADS]) == [
        t.push(IDS, g) for t, g in zip(own, [GRADS, 2 * GRADS, -GRADS], strict=True)]
    assert [t.content_digest() for t in fused] == [t.content_digest() for t in own]


def test_the_clip_comes_before_the_finite_check() -> None:
    """SGD (lr 10) with a finite gradient whose step overflows float32: refused (the row
    would not be finite) without a clip, applied as the clipped step with one."""
    one = np.array([5], dtype=np.uint64)
    huge = np.full((1, 3), 3e38, np.float32)
    plain, clipped = table("sgd", lr=10.0), table("sgd", lr=10.0, grad_clip=CLIP)
    before = plain.peek(one)[0]
    assert plain.push(one, huge).applied == 0 and plain.stats().refused_nonfinite == 1
    np.testing.assert_array_equal(plain.peek(one)[0], before)
    assert clipped.push(one, huge).applied == 1
    np.testing.assert_allclose(clipped.peek(one)[0], before - 10.0 * CLIP, rtol=1e-6)


def test_weight_clipping_bounds_every_pushed_weight_with_the_gradient_clip() -> None:
    t = table("sgd", grad_clip=CLIP, weight_bound=0.25)
    for _ in range(10):
        t.push(IDS, -GRADS)
    assert np.abs(rows(t)).max() == pytest.approx(0.25)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), "0.5x"])
def test_a_bad_clip_is_refused_naming_the_field_and_changes_nothing(bad: object) -> None:
    with pytest.raises(ConfigError, match="optimizer.grad_clip"):
        OptimizerConfig(kind="adagrad", grad_clip=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="optimizer.grad_clip"):
        TableConfig(name="t", dim=3, optimizer={"grad_clip": bad})  # type: ignore[arg-type]
    t = table("adagrad", grad_clip=CLIP)
    t.push(IDS, GRADS)
    before = t.content_digest()
    with pytest.raises(ConfigError, match="optimizer.grad_clip"):
        t.set_optimizer(grad_clip=bad)
    assert t.config.optimizer.grad_clip == CLIP and t.content_digest() == before
