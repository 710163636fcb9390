"""The synchronous route (one worker, window 1, shards in the process: the compute thread
reads every group's rows just before its step and applies their gradients just after) gives
exactly the synchronous run over the event loop: the same losses, bit for bit, and the same
rows on the PS afterwards as when every batch's rows are looked up after the previous push is
acknowledged."""

from __future__ import annotations

from typing import Any

import numpy as np

from services.common.sharding import ShardedIds
from services.loader.planted import SyntheticConfig, SyntheticDataset
from services.ps.inprocess import InProcessShards
from services.worker.config import ps_table_configs
from services.worker.embedding.routes import DirectHot
from services.worker.models import ModelConfig
from services.worker.trainer import Trainer

DATA = SyntheticConfig(seed=5)  # Zipf 2: consecutive batches share many ids


class OverTheLoop:
    """In-process shards reached only through the event loop (no direct reads): the
    pipeline then reads each batch's rows after the previous push, as over a network."""

    _HIDDEN = ("direct", "lookup_now", "push_now")

    def __init__(self, shards: InProcessShards) -> None:
        self._shards = shards

    def __getattr__(self, name: str) -> Any:
        if name in self._HIDDEN:
            raise AttributeError(name)
        return getattr(self._shards, name)


async def _run(rows: Any, batches: list, mode: str) -> tuple[list[float], Trainer]:
    async with Trainer(model=ModelConfig(name="dlrm"), rows_client=rows, lr=3e-3, seed=4,
                       mode=mode, staleness=1) as trainer:
        summary = await trainer.fit(batches)
    return summary.recent_losses, trainer


async def _rows_of(shards: InProcessShards, batches: list) -> np.ndarray:
    ids = {f: np.unique(np.concatenate([b.sparse[f].values for b in batches]))
           for f in DATA.sparse_names}
    layout, _ = ShardedIds.of_tables(ids, shards.num_shards)
    return await shards.lookup_sharded(layout)


async def test_the_synchronous_route_is_the_synchronous_run_bit_for_bit() -> None:
    batches = list(SyntheticDataset(DATA).batches(64, 64 * 40))
    for mode in ("sync", "hybrid"):  # hybrid with S = 1 (staleness auto's with such shards)
        ahead, over = (InProcessShards(ps_table_configs({f: 8 for f in DATA.sparse_names}),
                                       num_shards=2) for _ in range(2))
        losses, trainer = await _run(ahead, batches, mode)
        assert (policy := trainer.pipeline.policy) is not None and policy.synchronous
        want, plain = await _run(OverTheLoop(over), batches, mode)
        assert (policy := plain.pipeline.policy) is not None
        assert policy.direct is None and not policy.synchronous
        assert losses == want, mode
        np.testing.assert_array_equal(await _rows_of(ahead, batches),
                                      await _rows_of(over, batches))


async def test_an_update_applied_a_step_late_changes_the_run(monkeypatch: Any) -> None:
    """The test above can fail: a route whose reads miss the step before's update (a window
    of 2 in effect) trains another run."""
    batches = list(SyntheticDataset(DATA).batches(64, 64 * 20))
    apply = DirectHot.apply
    late: list[tuple[Any, ...]] = []

    def apply_the_one_before(self: DirectHot, plan: Any, grads: Any, split: Any) -> None:
        late.append((plan, grads, split))
        if len(late) > 1:
            apply(self, *late.pop(0))

    monkeypatch.setattr(DirectHot, "apply", apply_the_one_before)
    ahead, over = (InProcessShards(ps_table_configs({f: 8 for f in DATA.sparse_names}))
                   for _ in range(2))
    losses, _ = await _run(ahead, batches, "sync")
    want, _ = await _run(OverTheLoop(over), batches, "sync")
    assert losses != want
