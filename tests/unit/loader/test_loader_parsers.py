"""The one-pass text parser: values, multi-hot, and every kind of malformed line."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.errors import ConfigError
from services.loader.hashing import DenseTransform, hash_value
from services.loader.parsers import TextParser
from services.loader.schema import (
    FeatureSchema,
    TextLayout,
    avazu_layout,
    criteo_layout,
    load_schema_file,
)

RAW = DenseTransform(clip_min=None, log1p=False, fill=-99.0)


def criteo_line(label="1", dense=("1", "2"), cats=("a1", "b2", "c3")) -> str:
    return "\t".join([label, *dense, *cats])


def test_criteo_values_and_missing_fields():
    parser = TextParser(criteo_layout(2, 3), RAW)
    data = "\n".join([criteo_line(), criteo_line("0", ("", "-2.5"), ("", "x", "yy"))]).encode()
    out = parser.parse(data)
    assert out.size == 2 and not out.bad
    np.testing.assert_array_equal(out.labels, [1.0, 0.0])
    np.testing.assert_allclose(out.dense, [[1.0, 2.0], [-99.0, -2.5]])
    c1 = out.sparse["C1"]
    assert c1.lengths.tolist() == [1, 0]  # an empty categorical field has no id
    assert c1.values.tolist() == [hash_value("C1", "a1")]
    assert out.sparse["C3"].values.tolist() == [hash_value("C3", "c3"), hash_value("C3", "yy")]
    assert out.lines.tolist() == [0, 1]


def test_default_transform_is_log1p_of_clipped_counts():
    out = TextParser(criteo_layout(2, 1)).parse(b"1\t-5\t9\tz\n")
    np.testing.assert_allclose(out.dense, [[0.0, np.log(10.0)]], rtol=1e-6)


def test_multi_hot_splits_and_skips_empty_pieces():
    parser = TextParser(criteo_layout(1, 2, multi_hot=","), RAW)
    out = parser.parse(b"1\t3\ta,,b,\tq\n0\t4\t\tr,s\n")
    assert out.sparse["C1"].lengths.tolist() == [2, 0]
    assert out.sparse["C1"].values.tolist() == [hash_value("C1", "a"), hash_value("C1", "b")]
    assert out.sparse["C2"].lengths.tolist() == [1, 2]


@pytest.mark.parametrize("text,value", [("7", 7.0), (" 7 ", 7.0), ("-2.5", -2.5), ("+3", 3.0),
                                        ("1e3", 1000.0), ("2.5E-1", 0.25), (".5", 0.5),
                                        ("4.", 4.0)])
def test_numbers_accepted(text, value):
    out = TextParser(criteo_layout(1, 1), RAW).parse(f"1\t{text}\tc".encode())
    assert not out.bad
    assert out.dense[0, 0] == pytest.approx(value)


@pytest.mark.parametrize("text", ["x", "1e", "--1", "nan", "inf", "1.2.3", "0x10", "1 2", "."])
def test_non_numeric_dense_is_a_bad_record(text):
    out = TextParser(criteo_layout(1, 1), RAW).parse(f"1\t{text}\tc\n0\t1\td\n".encode())
    assert out.size == 1 and out.lines.tolist() == [1]
    assert [(b.position, b.reason) for b in out.bad] == [(0, "dense_not_numeric")]


def test_malformed_lines_are_rejected_and_the_rest_kept():
    good = criteo_line()
    lines = [good, "1\t2", good + "\textra", "x\t1\t2\ta\tb\tc", "", good,
             "1\t2\t3\t\xff\xfe\tb\tc", good + "\r"]
    data = b"\n".join(line.encode("latin-1") for line in lines) + b"\n"
    out = TextParser(criteo_layout(2, 3)).parse(data)
    assert out.lines.tolist() == [0, 5, 7]
    assert [(b.position, b.reason) for b in out.bad] == [
        (1, "column_count"), (2, "column_count"), (3, "label_not_numeric"),
        (4, "column_count"), (6, "invalid_utf8")]
    assert out.bad[0].raw == b"1\t2"
    # the CRLF line parsed like the others, and bad lines left no ids behind
    assert out.sparse["C3"].values.tolist() == [hash_value("C3", "c3")] * 3


def test_valid_utf8_is_accepted_and_hashed_as_bytes():
    out = TextParser(criteo_layout(0, 1)).parse("1\tpêche😀\n".encode())
    assert not out.bad
    assert out.sparse["C1"].values.tolist() == [hash_value("C1", "pêche😀")]


def test_avazu_layout_and_buckets():
    cols = ["id", "click", "hour", "site_id"]
    parser = TextParser(avazu_layout(cols, buckets=10))
    out = parser.parse(b"123,1,14102100,abc\n124,0,14102101,def\n")
    assert list(out.sparse) == ["hour", "site_id"]
    assert out.labels.tolist() == [1.0, 0.0]
    assert out.sparse["site_id"].values.tolist() == [hash_value("site_id", "abc", 10),
                                                     hash_value("site_id", "def", 10)]
    with pytest.raises(ConfigError, match="click"):
        avazu_layout(["id", "label", "x"])


def test_schema_file_layout(tmp_path):
    path = tmp_path / "schema.yaml"
    path.write_text("label: y\ndense: [age]\nsparse: [user, tags]\ndelimiter: ';'\n"
                    "header: false\ncolumns: [user, y, age, tags, junk]\n"
                    "multi_hot: {tags: '|'}\nbuckets: {user: 1000}\n")
    layout = load_schema_file(path).layout()
    out = TextParser(layout, RAW).parse(b"u1;1;33;a|b;zzz\nu2;0;;;zzz\n")
    assert out.labels.tolist() == [1.0, 0.0]
    np.testing.assert_allclose(out.dense[:, 0], [33.0, -99.0])
    assert out.sparse["user"].values.tolist() == [hash_value("user", "u1", 1000),
                                                  hash_value("user", "u2", 1000)]
    assert out.sparse["tags"].lengths.tolist() == [2, 0]


@pytest.mark.parametrize("body,match", [
    ("label: y\nsparse: [a]\ncolour: red\n", "unknown keys"),
    ("label: y\nsparse: [a]\nheader: false\n", "columns"),
    ("- not a mapping\n", "mapping"),
    ("label: y\nsparse: [a]\nmulti_hot: {b: ','}\n", "unknown sparse"),
    ("label: y\nsparse: [a]\nmulti_hot: {a: '::'}\n", "one ASCII character"),
])
def test_bad_schema_files(tmp_path, body, match):
    path = tmp_path / "s.yaml"
    path.write_text(body)
    with pytest.raises(ConfigError, match=match):
        load_schema_file(path)


def test_layout_validation():
    schema = FeatureSchema(dense=["d"], sparse=["s"], multi_hot={"s": ","})
    with pytest.raises(ConfigError, match="not in the file"):
        TextLayout(columns=["y", "s"], label="y", schema=schema)
    with pytest.raises(ConfigError, match="delimiter"):
        TextLayout(columns=["y", "d", "s"], label="y", schema=schema, delimiter=",")
    with pytest.raises(ConfigError, match="unique"):
        FeatureSchema(dense=["a"], sparse=["a"])


field_text = st.text(alphabet="abcdef0123456789xyz,", max_size=6)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["0", "1"]), st.integers(0, 10**6), field_text,
                          field_text), max_size=20))
def test_parser_matches_a_plain_python_reading(rows):
    parser = TextParser(criteo_layout(1, 2, multi_hot=","), RAW)
    data = "".join(f"{y}\t{d}\t{a}\t{b}\n" for y, d, a, b in rows).encode()
    out = parser.parse(data)
    assert out.size == len(rows) and not out.bad
    assert out.dense[:, 0].tolist() == [float(d) for _, d, _, _ in rows]
    for col, name in ((2, "C1"), (3, "C2")):
        pieces = [[p for p in r[col].split(",") if p] for r in rows]
        assert out.sparse[name].lengths.tolist() == [len(p) for p in pieces]
        assert out.sparse[name].values.tolist() == [hash_value(name, p) for ps in pieces
                                                    for p in ps]
