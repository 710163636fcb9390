"""Delimited text (Criteo TSV, Avazu CSV, schema CSV) → hashed columnar rows, in one pass.

A numba kernel walks the buffer once: it splits lines and fields, parses numbers, hashes
categorical bytes straight from the buffer (see :mod:`services.loader.hashing`), splits
multi-hot fields, and rejects malformed lines without stopping: wrong column count, a label
or dense value that is not a number, bytes that are not UTF-8. No Python per record.
Fields are not quoted (Criteo and Avazu never quote); a delimiter inside a value is a
wrong column count.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numba import njit

from services.common.batch import Jagged
from services.loader.hashing import DenseTransform, bucketize, finalize, fnv_byte
from services.loader.schema import TextLayout

__all__ = ["BadRecord", "Parsed", "REASONS", "TextParser"]

OK, BAD_COLUMNS, BAD_DENSE, BAD_LABEL, BAD_UTF8 = 0, 1, 2, 3, 4
REASONS = {BAD_COLUMNS: "column_count", BAD_DENSE: "dense_not_numeric",
           BAD_LABEL: "label_not_numeric", BAD_UTF8: "invalid_utf8"}


@dataclass(slots=True)
class BadRecord:
    """A rejected record: where it was, why, and its raw bytes (for the dead-letter sink)."""

    position: int
    reason: str
    raw: bytes


@dataclass(slots=True)
class Parsed:
    """Rows of one buffer, columnar; ``lines`` is each row's line index in the buffer."""

    labels: np.ndarray
    dense: np.ndarray
    sparse: dict[str, Jagged]
    lines: np.ndarray
    bad: list[BadRecord] = field(default_factory=list)

    @property
    def size(self) -> int:
        return int(self.labels.shape[0])


@njit(inline="always")
def _parse_exponent(buf: np.ndarray, i: int, e: int) -> tuple[int, bool]:
    """(exponent, ok) of ``[+-]digits`` in buf[i:e] (capped at 400)."""
    neg = False
    if i < e and (buf[i] == 45 or buf[i] == 43):
        neg = buf[i] == 45
        i += 1
    if i == e:
        return 0, False
    ex = 0
    while i < e:
        c = buf[i]
        if not 48 <= c <= 57:
            return 0, False
        ex = min(ex * 10 + (c - 48), 400)
        i += 1
    return (-ex if neg else ex), True


@njit(inline="always")
def _trim(buf: np.ndarray, s: int, e: int) -> tuple[int, int]:
    while s < e and buf[s] == 32:
        s += 1
    while e > s and buf[e - 1] == 32:
        e -= 1
    return s, e


@njit(inline="always")
def _parse_number(buf: np.ndarray, s: int, e: int) -> tuple[float, bool]:
    """(value, ok) of buf[s:e]; an empty field is (NaN, True); spaces around are allowed."""
    s, e = _trim(buf, s, e)
    if s == e:
        return np.nan, True
    neg = False
    if buf[s] == 45 or buf[s] == 43:
        neg = buf[s] == 45
        s += 1
    mant = 0.0
    digits = 0
    scale = 0
    seen_dot = False
    i = s
    while i < e:
        c = buf[i]
        if 48 <= c <= 57:
            mant = mant * 10.0 + (c - 48)
            digits += 1
            if seen_dot:
                scale -= 1
        elif c == 46 and not seen_dot:
            seen_dot = True
        else:
            break
        i += 1
    if digits == 0:
        return np.nan, False
    if i < e:
        if buf[i] != 101 and buf[i] != 69:  # e / E
            return np.nan, False
        ex, ok = _parse_exponent(buf, i + 1, e)
        if not ok:
            return np.nan, False
        scale += ex
    value = mant * 10.0 ** scale if scale != 0 else mant
    return (-value if neg else value), True


@njit(inline="always")
def _valid_utf8(buf: np.ndarray, s: int, e: int) -> bool:
    i = s
    while i < e:
        c = buf[i]
        if c < 0x80:
            i += 1
            continue
        if 0xC2 <= c <= 0xDF:
            n = 1
        elif 0xE0 <= c <= 0xEF:
            n = 2
        elif 0xF0 <= c <= 0xF4:
            n = 3
        else:
            return False
        if i + n >= e:
            return False
        for k in range(1, n + 1):
            if buf[i + k] & 0xC0 != 0x80:
                return False
        if (c == 0xE0 and buf[i + 1] < 0xA0) or (c == 0xED and buf[i + 1] > 0x9F) \
                or (c == 0xF0 and buf[i + 1] < 0x90) or (c == 0xF4 and buf[i + 1] > 0x8F):
            return False
        i += n + 1
    return True


@njit(nogil=True, cache=True)
def _parse_lines(buf, delim, roles, slots, seps, seeds, buckets, num_dense,  # noqa: C901
                 labels, dense, values, base, lengths, lines, bad_line, bad_code, bad_span):
    """Fill the output arrays; returns (rows, bad records, values written per feature)."""
    n = buf.shape[0]
    ncols = roles.shape[0]
    nsparse = seeds.shape[0]
    count = np.zeros(nsparse, dtype=np.int64)
    saved = np.zeros(nsparse, dtype=np.int64)
    row = 0
    nbad = 0
    line = 0
    pos = 0
    while pos < n:
        end = pos
        high = False
        fields = 1
        while end < n and buf[end] != 10:
            c = buf[end]
            if c == delim:
                fields += 1
            elif c >= 0x80:
                high = True
            end += 1
        stop = end - 1 if end > pos and buf[end - 1] == 13 else end
        code = 0
        if fields != ncols:
            code = 1
        elif high and not _valid_utf8(buf, pos, stop):
            code = 4
        for f in range(nsparse):
            saved[f] = count[f]
        col = 0
        fs = pos
        i = pos
        while code == 0:
            if i < stop and buf[i] != delim:
                i += 1
                continue
            if col >= ncols:
                code = 1
                break
            role = roles[col]
            if role == 1:
                v, ok = _parse_number(buf, fs, i)
                if not ok or np.isnan(v):
                    code = 3
                    break
                labels[row] = v
            elif role == 2:
                v, ok = _parse_number(buf, fs, i)
                if not ok:
                    code = 2
                    break
                dense[row, slots[col]] = v
            elif role == 3:
                f = slots[col]
                sep = seps[f]
                start = base[f] + count[f]
                w = start
                h = seeds[f]
                piece = 0
                for j in range(fs, i + 1):
                    if j == i or (sep != 0 and buf[j] == sep):
                        if piece > 0:
                            values[w] = bucketize(finalize(h), buckets[f])
                            w += 1
                        h = seeds[f]
                        piece = 0
                    else:
                        h = fnv_byte(h, buf[j])
                        piece += 1
                lengths[f, row] = w - start
                count[f] += w - start
            col += 1
            if i >= stop:
                break
            i += 1
            fs = i
        if code == 0 and col != ncols:
            code = 1
        if code == 0:
            lines[row] = line
            row += 1
        else:
            for f in range(nsparse):
                count[f] = saved[f]
            bad_line[nbad] = line
            bad_code[nbad] = code
            bad_span[nbad, 0] = pos
            bad_span[nbad, 1] = stop
            nbad += 1
        line += 1
        pos = end + 1
    return row, nbad, count


class TextParser:
    """Parses buffers of whole lines for one :class:`TextLayout` (thread-safe, reusable)."""

    def __init__(self, layout: TextLayout, dense_transform: DenseTransform | None = None) -> None:
        self.layout = layout
        self.schema = layout.schema
        self.transform = dense_transform or DenseTransform()
        self._roles, self._slots = layout.roles()
        self._seps = self.schema.separator_array()
        self._seeds = self.schema.seeds()
        self._buckets = self.schema.bucket_array()
        self._delim = layout.delimiter.encode()[0]

    def parse(self, data: bytes | bytearray | memoryview) -> Parsed:
        """Parse ``data`` (lines separated by ``\\n``; a final newline is optional).

        ``Parsed.bad`` positions are line indices within ``data``.
        """
        raw = bytes(data) if not isinstance(data, bytes) else data
        buf = np.frombuffer(raw, dtype=np.uint8)
        nlines = raw.count(b"\n") + (1 if raw and raw[-1] != 10 else 0)
        nsparse = len(self.schema.sparse)
        num_dense = len(self.schema.dense)
        caps = np.full(nsparse, nlines, dtype=np.int64)
        for f in np.flatnonzero(self._seps):
            caps[f] += raw.count(bytes([self._seps[f]]))
        base = np.zeros(nsparse, dtype=np.int64)
        np.cumsum(caps[:-1], out=base[1:])
        labels = np.empty(nlines, dtype=np.float32)
        dense = np.empty((nlines, num_dense), dtype=np.float64)
        values = np.empty(int(caps.sum()), dtype=np.uint64)
        lengths = np.zeros((nsparse, nlines), dtype=np.int32)
        lines = np.empty(nlines, dtype=np.int64)
        bad_line = np.empty(nlines, dtype=np.int64)
        bad_code = np.empty(nlines, dtype=np.int8)
        bad_span = np.empty((nlines, 2), dtype=np.int64)
        rows, nbad, count = _parse_lines(
            buf, self._delim, self._roles, self._slots, self._seps, self._seeds, self._buckets,
            num_dense, labels, dense, values, base, lengths, lines, bad_line, bad_code, bad_span)
        sparse = {name: Jagged(values[base[f]:base[f] + count[f]], lengths[f, :rows])
                  for f, name in enumerate(self.schema.sparse)}
        bad = [BadRecord(int(bad_line[k]), REASONS[int(bad_code[k])],
                         buf[bad_span[k, 0]:bad_span[k, 1]].tobytes()) for k in range(nbad)]
        return Parsed(labels=labels[:rows], dense=self.transform.apply(dense[:rows]),
                      sparse=sparse, lines=lines[:rows], bad=bad)
