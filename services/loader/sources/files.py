"""File sources: Criteo TSV, Avazu CSV, schema CSV/TSV (plain or gzip) and Parquet.

Files come from globs (sorted, then split among loader replicas), are read ``epochs`` times
(optionally in a seeded shuffled order per epoch), and in blocks of ``block_bytes`` of text
(or ``rows_per_block`` Parquet rows) parsed in a worker thread. A partition is one file in
one epoch, ``file:e{epoch}:{path}``; positions are 0-based line numbers (the header is line
0) or Parquet row numbers. With a ``state_file`` the committed position of every partition
is saved once all its earlier records are acknowledged, and a restart skips what was
committed. A truncated or corrupt gzip member ends that file with a bad record; the loader
goes on with the next file.
"""

from __future__ import annotations

import asyncio
import dataclasses
import glob
import json
import logging
import zlib
from collections import deque
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from services.common.batch import Jagged
from services.common.errors import ConfigError
from services.loader.arrow import ArrowConverter, infer_schema
from services.loader.batching import Settled
from services.loader.config import LoaderConfig, SourceKind, SourceSpec
from services.loader.parsers import BadRecord, Parsed, TextParser
from services.loader.schema import (
    FeatureSchema,
    SchemaFile,
    TextLayout,
    avazu_layout,
    criteo_layout,
    load_schema_file,
)
from services.loader.sources.base import SourceBlock, StateFile, parsed_block

__all__ = ["FileSource", "expand_globs", "read_text_blocks"]

log = logging.getLogger("persimmon.loader.files")

GZIP_MAGIC = b"\x1f\x8b"
ROWS_PER_BLOCK = 65536
PARSE_AHEAD = 4  # text blocks in a parser pool at once (file_blocks with a pool)
_END = object()


def expand_globs(patterns: list[str]) -> list[str]:
    """Every file matching any pattern, sorted, without duplicates."""
    files: dict[str, None] = {}
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        for m in matches:
            if Path(m).is_file():
                files[m] = None
    return list(files)


def source_files(spec: SourceSpec) -> list[str]:
    """The files of a file source spec; a ConfigError when it matches none (a directory is
    no file: its message says so)."""
    files = expand_globs(spec.globs())
    if not files:
        dirs = [g for g in spec.globs() if Path(g).is_dir()]
        hint = f": {dirs[0]} is a directory, give its files (e.g. {dirs[0]}/*)" if dirs else ""
        raise ConfigError(f"source {spec.text!r} matches no files{hint}")
    return files


def _raw_chunks(path: str, read_bytes: int, start: int) -> Iterator[tuple[bytes, Any]]:
    """Uncompressed bytes from ``start``; the last item may carry (reason, detail)."""
    with open(path, "rb") as fh:
        if fh.read(2) != GZIP_MAGIC:
            fh.seek(start)
            while chunk := fh.read(read_bytes):
                yield chunk, None
            return
        fh.seek(0)
        dec = zlib.decompressobj(wbits=31)
        skip = start
        while comp := fh.read(max(read_bytes // 4, 1)):
            try:
                if dec.eof:
                    dec = zlib.decompressobj(wbits=31)
                out = dec.decompress(comp)
                while dec.eof and dec.unused_data:  # concatenated gzip members
                    rest = dec.unused_data
                    dec = zlib.decompressobj(wbits=31)
                    out += dec.decompress(rest)
            except zlib.error as exc:
                yield b"", ("corrupt_gzip", str(exc))
                return
            if skip:
                cut = min(skip, len(out))
                out, skip = out[cut:], skip - cut
            if out:
                yield out, None
        if not dec.eof:
            yield b"", ("truncated_gzip", "the gzip stream ends before its end marker")


def read_text_blocks(path: str, block_bytes: int, start: int = 0,
                     header: bool = False) -> Iterator[tuple[str, bytes, int]]:
    """``("header", line, end)``, ``("lines", data, end)`` and at most one final
    ``("bad:<reason>", partial tail, end)``; ``end`` is the uncompressed byte offset after."""
    buf = bytearray()
    base = start
    want_header = header and start == 0
    for chunk, error in _raw_chunks(path, block_bytes, start):
        buf += chunk
        if want_header and (b"\n" in buf or error):
            cut = buf.find(b"\n") + 1 or len(buf)
            yield "header", bytes(buf[:cut]).rstrip(b"\r\n"), base + cut
            del buf[:cut]
            base += cut
            want_header = False
        if error is not None:
            cut = buf.rfind(b"\n") + 1
            if cut:
                yield "lines", bytes(buf[:cut]), base + cut
            yield f"bad:{error[0]}", bytes(buf[cut:]), base + len(buf)
            return
        if len(buf) >= block_bytes:
            cut = buf.rfind(b"\n") + 1
            if cut:
                yield "lines", bytes(buf[:cut]), base + cut
                del buf[:cut]
                base += cut
    if want_header and buf:
        yield "header", bytes(buf).rstrip(b"\r\n"), base + len(buf)
        return
    if buf:
        yield "lines", bytes(buf), base + len(buf)


def _parquet(path: str) -> pq.ParquetFile:
    """``path`` opened as a Parquet file, or ConfigError saying it is not one."""
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise ConfigError(f"{path} is not a Parquet file: {exc}") from exc


def _plain(value: Any) -> Any:
    """A dataclass or array as JSON-able values (for :meth:`FileSource.parse_settings`)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


def _count_lines(data: bytes) -> int:
    return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)


class FileSource:
    """Reads files; see the module docstring."""

    def __init__(self, spec: SourceSpec, config: LoaderConfig) -> None:
        self.spec = spec
        self.config = config
        files = source_files(spec)
        self.files = files[config.replica::config.replicas]
        self.transform = config.dense_transform()
        self.state = StateFile(config.state_file, spec.text)
        self._schema_file: SchemaFile | None = None
        if spec.params.get("schema"):
            self._schema_file = load_schema_file(spec.params["schema"])
        self.layout: TextLayout | None = None
        self.schema: FeatureSchema = FeatureSchema(sparse=["_"])  # replaced in start()
        self._parser: TextParser | None = None
        self._converter: ArrowConverter | None = None
        self._read: dict[str, dict[str, Any]] = {}
        self.malformed = 0
        self.records = 0

    # ---- set-up -----------------------------------------------------------------------------

    async def start(self) -> None:
        await asyncio.to_thread(self.resolve)

    def _header_of(self, path: str) -> list[str]:
        for kind, data, _ in read_text_blocks(path, 1 << 16, 0, header=True):
            if kind == "header":
                delim = self.layout.delimiter if self.layout else (
                    self._schema_file.delimiter if self._schema_file else ",")
                return data.decode("utf-8", "replace").split(delim)
        raise ConfigError(f"{path} is empty: no header line")

    def resolve(self) -> None:
        """Find the files' layout and parser (reading a header where the format has one)."""
        kind = self.spec.kind
        buckets = self.spec.int_param("buckets", 0)
        if kind is SourceKind.CRITEO:
            self.layout = criteo_layout(self.spec.int_param("dense", 13),
                                        self.spec.int_param("sparse", 26),
                                        multi_hot=self.spec.params.get("multi_hot") or None,
                                        buckets=buckets)
        elif kind is SourceKind.AVAZU:
            self.layout = avazu_layout(self._header_of(self.files[0]), buckets=buckets)
        elif kind is SourceKind.CSV:
            assert self._schema_file is not None  # SourceSpec.parse requires schema for csv
            header = self._header_of(self.files[0]) if self._schema_file.header else None
            self.layout = self._schema_file.layout(header)
        else:
            self._resolve_parquet(buckets)
            return
        self.schema = self.layout.schema
        self._parser = TextParser(self.layout, self.transform)

    def _resolve_parquet(self, buckets: int) -> None:
        label = self.spec.params.get("label", "label")
        if self._schema_file is not None:
            self.schema = self._schema_file.feature_schema()
            label = self._schema_file.label
        else:
            self.schema = infer_schema(_parquet(self.files[0]).schema_arrow, label, buckets)
        self._converter = ArrowConverter(self.schema, label, self.transform)

    # ---- reading ----------------------------------------------------------------------------

    def _epoch_order(self, epoch: int) -> list[str]:
        if not self.config.shuffle_files:
            return list(self.files)
        rng = np.random.default_rng([self.config.seed, epoch])
        return [self.files[i] for i in rng.permutation(len(self.files))]

    async def blocks(self) -> AsyncIterator[SourceBlock]:
        for epoch in range(self.config.epochs):
            for path in self._epoch_order(epoch):
                partition = f"file:e{epoch}:{path}"
                saved = self.state.get(partition) or {}
                if saved.get("done"):
                    continue
                gen = self._parquet_blocks(path, partition, saved) \
                    if self._converter is not None else self._text_blocks(path, partition, saved)
                while (block := await asyncio.to_thread(next, gen, _END)) is not _END:
                    assert isinstance(block, SourceBlock)
                    self.records += block.size
                    self.malformed += len(block.bad)
                    self._read[partition] = {"line": block.last + 1, "done": block.meta["done"]}
                    yield block

    def _text_blocks(self, path: str, partition: str, saved: dict[str, Any],
                     pool: Executor | None = None) -> Iterator[SourceBlock]:
        assert self.layout is not None
        line = int(saved.get("line", 0))
        pending: SourceBlock | None = None
        for kind, data, end in self._parsed_text(path, int(saved.get("byte", 0)), pool):
            if kind == "header":
                assert isinstance(data, bytes)
                if data.decode("utf-8", "replace").split(self.layout.delimiter) \
                        != self.layout.columns:
                    bad = BadRecord(line, "header_mismatch", data)
                    yield self._empty(partition, line, line, [bad], end, done=True)
                    return
                line += 1
                continue
            if pending is not None:
                yield pending
            if kind.startswith("bad:"):
                assert isinstance(data, bytes)
                pending = self._empty(partition, line, line, [BadRecord(line, kind[4:], data)],
                                      end, done=True)
                break
            assert isinstance(data, tuple)
            parsed, nlines = data
            positions = np.arange(line, line + nlines, dtype=np.int64)
            pending = parsed_block(partition, parsed, positions, line, line + nlines - 1,
                                   {"byte": end, "line": line + nlines, "done": False})
            line += nlines
        if pending is None:
            pending = self._empty(partition, line, line - 1, [], None, done=True)
        pending.meta["done"] = True
        yield pending

    def _parsed_text(self, path: str, start: int, pool: Executor | None
                     ) -> Iterator[tuple[str, bytes | tuple[Parsed, int], int]]:
        """:func:`read_text_blocks` with each ``lines`` block parsed, as (Parsed, lines);
        by ``pool``'s threads a few blocks ahead, in order, when one is given."""
        assert self._parser is not None and self.layout is not None
        parse = self._parser.parse
        blocks = read_text_blocks(path, self.config.block_bytes, start, self.layout.header)
        ahead: deque[tuple[str, Future[Parsed] | bytes, bytes, int]] = deque()
        for kind, data, end in blocks:
            if pool is None:
                yield kind, ((parse(data), _count_lines(data)) if kind == "lines" else data), end
                continue
            ahead.append((kind, pool.submit(parse, data) if kind == "lines" else data, data, end))
            while len(ahead) > PARSE_AHEAD or (ahead and not isinstance(ahead[0][1], Future)):
                yield self._done(*ahead.popleft())
        while ahead:
            yield self._done(*ahead.popleft())

    @staticmethod
    def _done(kind: str, work: Future[Parsed] | bytes, data: bytes, end: int
              ) -> tuple[str, bytes | tuple[Parsed, int], int]:
        if isinstance(work, Future):
            return kind, (work.result(), _count_lines(data)), end
        return kind, work, end

    def file_blocks(self, path: str, pool: Executor | None = None
                    ) -> Iterator[tuple[SourceBlock, int]]:
        """Every block of one file from its start, in order, with the bytes read so far
        (uncompressed, for text); text blocks parsed by ``pool`` when given. Call
        :meth:`resolve` first."""
        partition = f"file:{path}"
        if self._converter is not None:
            for block in self._parquet_blocks(path, partition, {}):
                yield block, 0
            return
        for block in self._text_blocks(path, partition, {}, pool):
            yield block, int(block.meta.get("byte") or 0)

    def parse_settings(self) -> dict[str, Any]:
        """What the parse of these files depends on, as plain values: the layout (or the
        Parquet schema and label) and the dense transform."""
        how: Any = self.layout if self.layout is not None else {
            "schema": self.schema, "label": self.spec.params.get("label", "label")}
        return json.loads(json.dumps({"layout": how, "dense": self.transform},
                                     default=_plain, sort_keys=True))

    def _parquet_blocks(self, path: str, partition: str, saved: dict[str, Any]
                        ) -> Iterator[SourceBlock]:
        assert self._converter is not None
        start = int(saved.get("line", 0))
        pf = _parquet(path)
        total = pf.metadata.num_rows
        row = 0
        emitted = False
        for record_batch in pf.iter_batches(batch_size=ROWS_PER_BLOCK,
                                            columns=self._converter.columns):
            n = record_batch.num_rows
            if row + n <= start:
                row += n
                continue
            skip = max(0, start - row)
            table = record_batch.slice(skip)
            first = row + skip
            parsed = self._converter.convert(table)
            positions = np.arange(first, first + table.num_rows, dtype=np.int64)
            row += n
            emitted = True
            yield parsed_block(partition, parsed, positions, first, row - 1,
                               {"line": row, "done": row >= total})
        if not emitted:
            yield self._empty(partition, start, start - 1, [], None, done=True)

    def _empty(self, partition: str, first: int, last: int, bad: list[BadRecord],
               end: int | None, *, done: bool) -> SourceBlock:
        meta: dict[str, Any] = {"line": last + 1, "done": done}
        if end is not None:
            meta["byte"] = end
        names = self.schema.sparse
        return SourceBlock(partition=partition, first=first, last=last,
                           labels=np.zeros(0, np.float32),
                           dense=np.zeros((0, len(self.schema.dense)), np.float32),
                           sparse={n: Jagged(np.zeros(0, np.uint64), np.zeros(0, np.int32))
                                   for n in names},
                           positions=np.zeros(0, np.int64), bad=bad, meta=meta)

    # ---- commits and reporting --------------------------------------------------------------

    async def commit(self, settled: Settled) -> None:
        if not settled.advanced:
            return
        for partition, chunk in settled.advanced.items():
            self.state.update(partition, **chunk.meta)
        await self.state.save()

    async def dead_letter(self, block: SourceBlock) -> None:
        """Files have no dead-letter topic; the loader's dead-letter file gets the records."""

    def offsets(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for partition in {*self.state.partitions, *self._read}:
            saved = self.state.get(partition) or {}
            read = self._read.get(partition, {})
            out[partition] = {"committed": saved.get("line", 0),
                              "committed_byte": saved.get("byte"),
                              "read": read.get("line", saved.get("line", 0)),
                              "done": bool(saved.get("done")), "lag": None}
        return out

    def describe(self) -> dict[str, Any]:
        return {"spec": self.spec.text, "kind": self.spec.kind.value, "files": self.files,
                "epochs": self.config.epochs, "records": self.records,
                "malformed": self.malformed, **self.schema.describe()}

    async def close(self) -> None:
        """Nothing to release: files are opened per read."""
