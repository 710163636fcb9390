"""``persimmon train``'s data specs: the planted profile's parameters reach both splits."""

from __future__ import annotations

import argparse

import pytest

from services.common.errors import ConfigError
from services.local.train import data_specs


def specs(train: str, eval_data: str | None = None) -> tuple[str, str | None]:
    return data_specs(argparse.Namespace(train_data=train, eval_data=eval_data, eval_rows=4096))


def test_the_profile_travels_to_the_test_split(tmp_path):
    train, test = specs("synthetic:1000?profile=criteo&max_vocab=5000&zipf=1.2")
    assert train == "synthetic:1000?profile=criteo&max_vocab=5000&zipf=1.2"
    assert test == "synthetic:4096?profile=criteo&max_vocab=5000&zipf=1.2&split=test"
    assert specs("synthetic") == ("synthetic:65536", "synthetic:4096?split=test")
    # a split given with the training data is the training data's own business
    assert specs("synthetic:10?split=test&profile=toy")[0] == "synthetic:10?profile=toy"
    (tmp_path / "x.tsv").write_text("")
    held_out = f"criteo:{tmp_path}/x.tsv"
    assert specs("synthetic:10", held_out)[1] == held_out


def test_bad_specs_fail_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match="--eval-data: source .* matches no files"):
        specs("synthetic:10", f"criteo:{tmp_path}/x.tsv")
    with pytest.raises(ConfigError, match="row count"):
        specs("synthetic:many")
    with pytest.raises(ConfigError):
        specs("synthetic:10?profile=criteo&colour=red")


@pytest.mark.parametrize(("flags", "message"), [
    (["--keep-best", "true"], "give validation data"),
    (["--validation-data", "synthetic:512?split=validation"], "set eval_every"),
    (["--validation-data", "synthetic:512?split=validation", "--eval-every", "4",
      "--workers", "2"], "needs the embedded PS"),
    (["--validation-data", "synthetic:512?split=validation", "--eval-every", "4",
      "--ps", "processes"], "--keep-best false"),
    (["--validation-data", "bogus:/nowhere", "--eval-every", "4"], "unknown source kind"),
    (["--validation-fraction", "0.2", "--eval-every", "4"], "read through the column cache"),
    (["--validation-fraction", "0.2", "--eval-every", "4", "--validation-data",
      "synthetic:512?split=validation"], "not both"),
    (["--validation-fraction", "1", "--eval-every", "4"], "must be in (0, 1)"),
    (["--id-weights", "--model", "dlrm"], "not of dlrm"),
])
def test_keep_best_without_what_it_needs_starts_nothing(
        flags: list[str], message: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import services.local.train as train
    from services.cli import main

    def started(**_: object) -> None:
        raise AssertionError("the local cluster started")
    monkeypatch.setattr(train, "train_on_local_cluster", started)
    assert main(["train", "--train-data", "synthetic:1024", *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flags", [[], ["--id-weights"]])
def test_id_weights_reach_the_model_config(flags: list[str], monkeypatch: pytest.MonkeyPatch,
                                           tmp_path) -> None:
    import services.local.train as train
    from services.cli import main

    seen = {}

    def fake(**kwargs: object) -> dict:
        seen.update(kwargs)
        raise SystemExit(0)
    monkeypatch.setattr(train, "train_on_local_cluster", fake)
    with pytest.raises(SystemExit):
        main(["train", "--train-data", "synthetic:1024", "--model", "deepfm", *flags])
    assert seen["model"].id_weights is bool(flags)
