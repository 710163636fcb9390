"""The dense exchange on one rank: what it refuses, what it sets up without a group, and the
rows of bytes it reports (the multi-rank behaviour: tests/integration/compression)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from services.common.errors import ConfigError
from services.worker.config import TrainerConfig
from services.worker.dense_exchange import DenseExchange
from services.worker.sync import make_sync


@pytest.mark.parametrize("settings", [{"dense_codec": "fp16"},
                                      {"dense_optimizer": "onebit_adam"}])
def test_a_given_sync_is_refused_with_a_codec_that_sets_up_its_own(settings) -> None:
    with pytest.raises(ConfigError, match="do not pass a sync strategy"):
        DenseExchange(TrainerConfig(**settings), sync_given=True)
    DenseExchange(TrainerConfig(**settings))  # without one: fine
    DenseExchange(TrainerConfig(), sync_given=True)  # no codec: fine


def test_one_rank_keeps_the_given_sync_and_sets_up_nothing() -> None:
    exchange = DenseExchange(TrainerConfig(dense_codec="adaquant"))
    given = make_sync("allreduce")
    assert exchange.sync_for(nn.Linear(2, 1), given, several=False) is given
    assert exchange.sync_for(nn.Linear(2, 1), None, several=False) is None
    # nothing set up: no bytes, no dense level; the loss is still shared (adaquant follows it)
    assert exchange.after_loss(torch.tensor(0.25)) == 0.25
    assert exchange.codec_rows() == [] and exchange.dense_bytes() == {}
    assert list(exchange.levels["dense"]) == []


def test_without_an_adaptive_codec_the_loss_is_not_shared() -> None:
    exchange = DenseExchange(TrainerConfig())
    assert math.isnan(exchange.after_loss(torch.tensor(0.25)))
    assert not exchange.feeds_grads_codec
    assert DenseExchange(TrainerConfig(grads_codec="adaquant")).feeds_grads_codec


def test_dct_mp_sparsifies_and_reports_its_bytes() -> None:
    exchange = DenseExchange(TrainerConfig(activation_keep=0.25))
    pooled = {"f": torch.randn(8, 16)}
    kept = exchange.sparsify(pooled)["f"]
    assert 0 < int((kept != 0).sum()) < kept.numel()
    (row,) = exchange.codec_rows()
    assert (row["stream"], row["codec"], row["direction"]) == ("activations", "dct_mp", "sent")
    assert row["raw_bytes"] == 8 * 8 * 16 and 0 < row["wire_bytes"] < row["raw_bytes"]
    assert exchange.activation_bytes()["raw_bytes"] == row["raw_bytes"]
    # without activation_keep the pooled inputs pass as given
    assert DenseExchange(TrainerConfig()).sparsify(pooled) is pooled
