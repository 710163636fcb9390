"""Parsing message payloads (Kafka records, Redis stream entries): one record per message.

``format=criteo`` (or ``csv`` with a schema) joins the payloads with newlines and runs the
text parser once; ``format=json`` reads the objects with Arrow's JSON reader. Either way a
bad message becomes a :class:`BadRecord` whose position is the message's index, and the
others go on. Payloads with an embedded newline, empty payloads and undecodable JSON are bad.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.json as pajson

from services.common.batch import Jagged
from services.loader.arrow import ArrowConverter
from services.loader.config import SourceSpec
from services.loader.hashing import DenseTransform
from services.loader.parsers import BadRecord, Parsed, TextParser
from services.loader.schema import FeatureSchema
from services.loader.sources.base import message_layout

__all__ = ["MessageParser"]


def _concat(parts: list[Parsed], names: list[str], num_dense: int) -> Parsed:
    if not parts:
        return Parsed(labels=np.zeros(0, np.float32), dense=np.zeros((0, num_dense), np.float32),
                      sparse={n: Jagged(np.zeros(0, np.uint64), np.zeros(0, np.int32))
                              for n in names}, lines=np.zeros(0, np.int64))
    return Parsed(labels=np.concatenate([p.labels for p in parts]),
                  dense=np.concatenate([p.dense for p in parts]),
                  sparse={n: Jagged(np.concatenate([p.sparse[n].values for p in parts]),
                                    np.concatenate([p.sparse[n].lengths for p in parts]))
                          for n in names},
                  lines=np.concatenate([p.lines for p in parts]),
                  bad=[b for p in parts for b in p.bad])


class MessageParser:
    """Parses a list of payloads; ``Parsed.lines`` and bad positions are message indices."""

    def __init__(self, spec: SourceSpec, transform: DenseTransform) -> None:
        self.format, layout, schema_file = message_layout(spec)
        self._text = TextParser(layout, transform) if layout is not None else None
        self._json: ArrowConverter | None = None
        if layout is not None:
            self.schema: FeatureSchema = layout.schema
        else:
            self.schema = schema_file.feature_schema()
            self._json = ArrowConverter(self.schema, schema_file.label, transform)
            fields = [pa.field(schema_file.label, pa.float64())]
            fields += [pa.field(n, pa.float64()) for n in self.schema.dense]
            self._json_schema = pa.schema(fields)

    def parse(self, payloads: list[bytes | None]) -> Parsed:
        bad: list[BadRecord] = []
        keep: list[int] = []
        for i, p in enumerate(payloads):
            if not p:
                bad.append(BadRecord(i, "empty_message", b""))
            elif b"\n" in p.rstrip(b"\r\n"):
                bad.append(BadRecord(i, "embedded_newline", p))
            else:
                keep.append(i)
        index = np.asarray(keep, dtype=np.int64)
        good = [payloads[i].rstrip(b"\r\n") for i in keep]  # type: ignore[union-attr]
        parsed = self._parse_text(good) if self._text is not None else self._parse_json(good)
        for record in parsed.bad:
            record.position = int(index[record.position])
        parsed.lines = index[parsed.lines]
        parsed.bad = sorted(bad + parsed.bad, key=lambda b: b.position)
        return parsed

    def _parse_text(self, payloads: list[bytes]) -> Parsed:
        assert self._text is not None
        return self._text.parse(b"\n".join(payloads) + b"\n" if payloads else b"")

    def _read_json(self, payloads: list[bytes], typed: bool = True) -> Parsed:
        assert self._json is not None
        opts = pajson.ParseOptions(explicit_schema=self._json_schema if typed else None,
                                   unexpected_field_behavior="infer")
        table = pajson.read_json(io.BytesIO(b"\n".join(payloads)), parse_options=opts)
        if table.num_rows != len(payloads):
            raise pa.ArrowInvalid("row count differs from message count")
        return self._json.convert(table)

    def _parse_json(self, payloads: list[bytes]) -> Parsed:
        """The fast path reads all payloads at once; on any error each is read alone."""
        if not payloads:
            return _concat([], self.schema.sparse, len(self.schema.dense))
        try:
            return self._read_json(payloads)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
            pass
        parts: list[Parsed] = []
        for i, payload in enumerate(payloads):
            reason = None
            try:
                if not isinstance(json.loads(payload), dict):
                    reason = "not_an_object"
            except ValueError:
                reason = "invalid_json"
            if reason is None:
                try:  # alone and untyped: a bad label or dense value is reported as such
                    part = self._read_json([payload], typed=False)
                except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
                    reason = "json_types"
            if reason is not None:
                part = _concat([], self.schema.sparse, len(self.schema.dense))
                part.bad = [BadRecord(0, reason, payload)]
            part.lines = part.lines + i
            for record in part.bad:
                record.position += i
            parts.append(part)
        return _concat(parts, self.schema.sparse, len(self.schema.dense))
