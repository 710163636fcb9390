"""The protocol's JSON Schema, generated from the messages (:mod:`services.common.messages`).

``python -m services.common.protocol_schema --schema`` prints it; ``--update
docs/protocol.md`` rewrites that file's schema section (a test fails when they differ).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

import msgspec

from services.common.messages import LOADER_METHODS, PS_METHODS, ErrorReply

__all__ = ["SCHEMA_BEGIN", "SCHEMA_END", "schema", "schema_text", "update_docs"]


def schema() -> dict[str, Any]:
    """The JSON Schema of every message (``$defs``) and, per method, its request and reply
    (arrays' ``data`` is msgpack bin: a base64 string in JSON terms)."""
    methods = {f"{service}/{name}": pair for service, table in
               (("persimmon.PS", PS_METHODS), ("persimmon.Loader", LOADER_METHODS))
               for name, pair in table.items()}
    types: list[Any] = [t for pair in methods.values() for t in pair] + [ErrorReply]
    refs, defs = msgspec.json.schema_components(types, ref_template="#/$defs/{name}")
    named = iter(refs)
    return {"methods": {m: {"request": next(named), "reply": next(named)} for m in methods},
            "error": next(named), "$defs": defs}


SCHEMA_BEGIN = "<!-- schema: begin (python -m services.common.protocol_schema --update docs/protocol.md) -->"
SCHEMA_END = "<!-- schema: end -->"


def schema_text() -> str:
    """:func:`schema` as docs/protocol.md holds it: one line per definition and method."""
    doc = schema()

    def block(key: str) -> str:
        rows = [f"  {json.dumps(k)}: {json.dumps(v, sort_keys=True)}"
                for k, v in sorted(doc[key].items())]
        return f' "{key}": {{\n' + ",\n".join(rows) + "\n }"
    error = json.dumps(doc["error"], sort_keys=True)
    return "{\n" + block("$defs") + f',\n "error": {error},\n' + block("methods") + "\n}\n"


def update_docs(path: str) -> bool:
    """Rewrite the schema section of the markdown file ``path``; True when it changed."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    head, _, rest = text.partition(SCHEMA_BEGIN + "\n")
    _, _, tail = rest.partition(SCHEMA_END)
    if not rest or not tail and SCHEMA_END not in rest:
        raise SystemExit(f"{path} has no schema section ({SCHEMA_BEGIN} ... {SCHEMA_END})")
    new = f"{head}{SCHEMA_BEGIN}\n```json\n{schema_text()}```\n{SCHEMA_END}{tail}"
    if new != text:
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
    return new != text


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.common.protocol_schema",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--schema", action="store_true",
                        help="print the protocol's JSON Schema (as in docs/protocol.md)")
    parser.add_argument("--update", metavar="MARKDOWN",
                        help="rewrite the schema section of this file (docs/protocol.md)")
    args = parser.parse_args(argv)
    if args.update:
        print(f"{args.update}: {'updated' if update_docs(args.update) else 'up to date'}")
    elif args.schema:
        sys.stdout.write(schema_text())
    else:
        parser.print_help()
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
