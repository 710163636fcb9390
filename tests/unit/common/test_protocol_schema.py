"""docs/protocol.md's JSON Schema section is the one the messages generate."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from services.common import messages as m
from services.common.protocol_schema import SCHEMA_BEGIN, schema, schema_text, update_docs

DOCS = Path(__file__).resolve().parents[3] / "docs" / "protocol.md"


def test_the_docs_hold_the_schema_the_code_generates():
    text = DOCS.read_text(encoding="utf-8")
    assert f"{SCHEMA_BEGIN}\n```json\n{schema_text()}```\n" in text, (
        "docs/protocol.md's schema differs from the messages: run "
        "python -m services.common.protocol_schema --update docs/protocol.md")


def test_every_method_and_its_messages_are_in_the_schema():
    doc = schema()
    methods = {f"persimmon.PS/{n}" for n in m.PS_METHODS} | {
        f"persimmon.Loader/{n}" for n in m.LOADER_METHODS}
    assert set(doc["methods"]) == methods
    push = doc["$defs"]["PushRequest"]
    assert push["additionalProperties"] is False and "seq" in push["required"]
    assert doc["$defs"]["WireArray"]["properties"]["shape"]["maxItems"] == 8
    assert "kind" in doc["$defs"]["BatchItem"]["required"]


def test_update_rewrites_a_drifted_section_and_only_it(tmp_path):
    copy = tmp_path / "protocol.md"
    shutil.copy(DOCS, copy)
    assert not update_docs(str(copy))  # up to date: unchanged
    drifted = copy.read_text(encoding="utf-8").replace('"PushRequest": {', '"PushRequest": {"x": 1, ', 1)
    copy.write_text(drifted, encoding="utf-8")
    assert update_docs(str(copy))
    assert copy.read_text(encoding="utf-8") == DOCS.read_text(encoding="utf-8")


def test_a_file_without_the_section_is_refused(tmp_path):
    other = tmp_path / "other.md"
    other.write_text("# nothing here\n", encoding="utf-8")
    with pytest.raises(SystemExit, match="no schema section"):
        update_docs(str(other))
    assert other.read_text(encoding="utf-8") == "# nothing here\n"
