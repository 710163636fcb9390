"""The feature spec featurizes raw records as the loader did in training; bad input is a 400."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.errors import ConfigError, InvalidArgument
from services.loader import FeatureSpec, spec_from_source
from services.loader.hashing import DenseTransform, hash_value
from services.loader.parsers import TextParser
from services.loader.schema import criteo_layout

LAYOUT = criteo_layout(2, 3, multi_hot=",", buckets=0)
SPEC = FeatureSpec.from_layout(LAYOUT, DenseTransform(clip_max=50.0), kind="criteo")
LINES = ["1\t3\t\ta\tx,y\t", "0\t-4\t70\t42\t\tz", "0\t\t2\tb\tq,q,r\t9"]
RECORDS = [{"I1": 3, "I2": None, "C1": "a", "C2": "x,y", "C3": None},
           {"I1": -4, "I2": 70, "C1": 42, "C2": None, "C3": "z"},
           {"I1": None, "I2": 2.0, "C1": "b", "C2": ["q", "q", "r"], "C3": 9}]


def test_json_records_and_lines_get_the_training_ids() -> None:
    trained = TextParser(LAYOUT, DenseTransform(clip_max=50.0)).parse(
        ("\n".join(LINES) + "\n").encode())
    for features in (SPEC.records(RECORDS), SPEC.lines(LINES)):
        np.testing.assert_array_equal(features.dense, trained.dense)
        for name in ("C1", "C2", "C3"):
            np.testing.assert_array_equal(features.sparse[name].values,
                                          trained.sparse[name].values)
            np.testing.assert_array_equal(features.sparse[name].lengths,
                                          trained.sparse[name].lengths)
    features = SPEC.records(RECORDS)
    assert features.sparse["C2"].lengths.tolist() == [2, 0, 3]
    assert features.sparse["C1"].values[1] == hash_value("C1", "42")
    assert features.dense[1].tolist() == pytest.approx([0.0, np.log1p(50.0)])


def test_buckets_apply() -> None:
    spec = FeatureSpec(dense=[], sparse=["u"], buckets={"u": 7})
    ids = spec.records([{"u": "alice"}, {"u": "bob"}]).sparse["u"].values
    assert ids.tolist() == [hash_value("u", "alice", 7), hash_value("u", "bob", 7)]
    assert int(ids.max()) < 7


def test_spec_round_trips_through_json() -> None:
    again = FeatureSpec.from_dict(SPEC.to_dict())
    assert again == SPEC
    assert spec_from_source("criteo:x.gz?dense=2&sparse=3&multi_hot=,").multi_hot == {
        "C1": ",", "C2": ",", "C3": ","}
    assert spec_from_source("synthetic:100").layout == "criteo"
    with pytest.raises(ConfigError):
        spec_from_source("parquet:x.parquet")
    with pytest.raises(ConfigError):
        FeatureSpec(layout="xml", sparse=["a"])


@pytest.mark.parametrize(("records", "match"), [
    ([], "no records"),
    ([["a"]], "must be a JSON object"),
    ([{**RECORDS[0], "C9": "x"}], "unknown fields"),
    ([{k: v for k, v in RECORDS[0].items() if k != "C1"}], "lacks fields"),
    ([{**RECORDS[0], "I1": "3"}], "must be a number"),
    ([{**RECORDS[0], "I1": True}], "must be a number"),
    ([{**RECORDS[0], "I1": float("inf")}], "'I1' must be a finite number or null, got inf"),
    ([{**RECORDS[0], "I1": float("nan")}], "must be a finite number"),
    ([{**RECORDS[0], "I1": 10 ** 400}], "must be a finite number or null, got an integer of "
                                        "401 digits"),
    ([{**RECORDS[0], "C1": 1.5}], "must be a string"),
    ([{**RECORDS[0], "C1": {"a": 1}}], "must be a string"),
    ([{**RECORDS[0], "C2": ["a", None]}], "must be a string"),
])
def test_bad_records_are_refused(records: list, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        SPEC.records(records)


@pytest.mark.parametrize(("lines", "match"), [
    (["1\t2\tx\ty\tz"], "malformed"),              # a column short
    (["1\tnope\t2\ta\tb\tc"], "malformed"),        # dense not a number
    (["1\t2\t3\ta\tb\tc\nx"], "newline"),
    ([5], "strings"),
])
def test_bad_lines_are_refused(lines: list, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        SPEC.lines(lines)


def test_a_json_model_takes_no_lines() -> None:
    with pytest.raises(InvalidArgument, match="records"):
        FeatureSpec(sparse=["u"]).lines(["x"])
