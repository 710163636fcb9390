"""The step's kernels are loaded or compiled before the first timed step
(:mod:`services.worker.warmup`), and the warm-up leaves the run as it was."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from services.common.errors import InvalidArgument, NotFound
from services.loader.planted import SyntheticConfig, SyntheticDataset
from services.ps.inprocess import InProcessShards
from services.worker.config import ps_table_configs
from services.worker.models import DenseNorm, ModelConfig
from services.worker.trainer import Trainer
from services.worker.warmup import first_samples

ROOT = Path(__file__).resolve().parents[3]
DATA = SyntheticConfig(seed=0)
FEATURES = DATA.sparse_names

# A fresh process (numba's signatures are the process's: an earlier test's calls would hide a
# kernel first called inside a step): fits that each record every kernel's signatures as
# their first step begins, then print, per fit, the signatures that came after (any load
# from numba's disk cache, or compile, inside the steps). The fits differ in what gives the
# kernels their tuple lengths: the number of tables of a request, of features pooled, of
# groups (tables of two dims), the model, the hot tables' groups of their own (3 of the 8
# tables: at most 10 distinct ids in the first batch of 64).
CHILD = """
import asyncio, json, sys
from numba.core.registry import CPUDispatcher
from services.loader.planted import SyntheticConfig, SyntheticDataset
from services.ps.inprocess import InProcessShards
from services.worker.config import ps_table_configs
from services.worker.models import ModelConfig
from services.worker.trainer import Trainer

def signatures():
    return {f"{name}.{attr}": set(map(str, value.signatures))
            for name, module in list(sys.modules.items())
            if name.startswith(("services.", "clients."))
            for attr, value in list(vars(module).items()) if isinstance(value, CPUDispatcher)}

async def fit(model, dims, **settings):
    data = SyntheticDataset(SyntheticConfig(seed=0))
    shards = InProcessShards(ps_table_configs(dict(zip(data.config.sparse_names, dims))))
    trainer = Trainer(model=ModelConfig(name=model), rows_client=shards, mode="hybrid",
                      staleness=4, **settings)
    at_first_step = {}
    step = trainer.train_step

    def first_step(item):
        if not at_first_step:
            at_first_step.update(signatures())
        return step(item)

    trainer.train_step = first_step
    async with trainer:
        await trainer.fit(data.batches(64, 64 * 10))
    return {k: sorted(v - at_first_step.get(k, set())) for k, v in signatures().items()
            if v - at_first_step.get(k, set())}

async def main():
    runs = {"dlrm": await fit("dlrm", [8] * 8),
            "deepfm, two dims": await fit("deepfm", [8] * 4 + [4] * 4),
            "dlrm, hot tables": await fit("dlrm", [8] * 8, hot_ratio=0.16)}
    print(json.dumps(runs))

asyncio.run(main())
"""


def test_a_fit_loads_or_compiles_no_kernel_after_its_first_step_began() -> None:
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True,
                          text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads(done.stdout.strip().splitlines()[-1])
    assert runs == {"dlrm": {}, "deepfm, two dims": {}, "dlrm, hot tables": {}}


async def test_the_warm_up_updates_no_statistic_and_sets_the_time_to_the_first_step() -> None:
    shards = InProcessShards(ps_table_configs({f: 8 for f in FEATURES}))
    async with Trainer(model=ModelConfig(name="dlrm", dense_norm=True), rows_client=shards,
                       mode="hybrid", staleness=4) as trainer:
        summary = await trainer.fit(SyntheticDataset(DATA).batches(64, 64 * 5))
        norm = trainer.module.dense_norm if trainer.module is not None else None
    assert isinstance(norm, DenseNorm)
    assert int(norm.count) == 64 * 5  # the training samples' statistics only
    assert math.isfinite(summary.time_to_first_step_s) and summary.time_to_first_step_s > 0
    assert summary.as_dict()["time_to_first_step_s"] == summary.time_to_first_step_s


def test_first_samples_cuts_every_feature_and_keeps_the_dtypes() -> None:
    batch = next(iter(SyntheticDataset(DATA).batches(64, 64)))
    cut = first_samples(batch, 3)
    assert cut.size == 3 and cut.dense.shape == (3, batch.num_dense)
    np.testing.assert_array_equal(cut.labels, batch.labels[:3])
    for name, feature in batch.sparse.items():
        got = cut.sparse[name]
        assert got.values.dtype == feature.values.dtype
        assert got.lengths.dtype == feature.lengths.dtype
        np.testing.assert_array_equal(got.lengths, feature.lengths[:3])
        np.testing.assert_array_equal(got.values, feature.values[:int(feature.lengths[:3].sum())])
    assert first_samples(batch, 1000).size == 64


def test_in_process_shards_warm_groups_of_one_dim_once() -> None:
    shards = InProcessShards(ps_table_configs({"a": 8, "b": 8, "c": 4}))
    assert shards.shards[0].dim_groups() == [["a", "b"], ["c"]]
    assert shards.warm_up() is shards and shards.warm_up([["a", "b"]]) is shards
    with pytest.raises(InvalidArgument, match="one dim"):
        shards.warm_up([["a", "c"]])
    with pytest.raises(NotFound):
        shards.warm_up([["a", "nope"]])
