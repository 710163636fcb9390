"""Parse once: a file's hashed columns kept on disk and memory-mapped on reading.

The first pass over a file source writes, for each file, the columns its parse gives —
labels, dense values, every sparse feature's ids and, where a sample may hold other than one
id, its offsets — as raw little-endian arrays in a directory of the cache
(:func:`default_cache_dir`). The directory is named by what the parse depends on (the file's
real path, the layout or schema, the dense transform, :data:`CACHE_VERSION`); its manifest
also records the file's size and modification time and each array's length and CRC-32.
An entry is used only when all of that matches: a file that changed makes it stale, a write
cut short or a flipped bit makes it corrupt, and either is rebuilt, never trusted. Records the
parser rejects are counted in the manifest (``malformed``), not cached.

:class:`CachedData` is what a trainer reads: batches cut from the mapped columns, each epoch
in a seeded order (the files shuffled, then each file's rows), batch ``b`` to rank
``b % world``. It pickles as paths, so worker processes map the same pages.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import zlib
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from services.common.batch import Batch, Jagged
from services.common.errors import ConfigError
from services.loader.config import LoaderConfig, SourceSpec
from services.loader.sources.files import FileSource

__all__ = ["CACHE_VERSION", "CachedData", "CachedShare", "ColumnCache", "FileColumns",
           "default_cache_dir"]

log = logging.getLogger("persimmon.loader.cache")

CACHE_VERSION = 1
MANIFEST = "manifest.json"
_CRC_CHUNK = 64 << 20
_BATCHES_PER_HOP = 8  # batches cut in one trip to a thread (keeps the event loop free)


def default_cache_dir() -> Path:
    """``$PERSIMMON_CACHE_DIR``, else ``$XDG_CACHE_HOME/persimmon/columns``, else
    ``~/.cache/persimmon/columns``."""
    if os.environ.get("PERSIMMON_CACHE_DIR"):
        return Path(os.environ["PERSIMMON_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "persimmon" / "columns"


def _identity(path: str) -> dict[str, Any]:
    st = os.stat(path)
    return {"path": os.path.realpath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _mapped(path: Path, array: dict[str, Any]) -> np.ndarray:
    """A column file as a read-only array (a plain ndarray over the mapping: indexing a
    ``np.memmap`` costs a subclass's bookkeeping on every call)."""
    shape, dtype = tuple(array["shape"]), np.dtype(array["dtype"])
    if not int(np.prod(shape)):
        return np.zeros(shape, dtype)
    return np.asarray(np.memmap(path, dtype=dtype, mode="r", shape=shape))


def _crc_of(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CRC_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


class _ArrayWriter:
    """One column written block by block, its CRC-32 kept as it goes."""

    def __init__(self, path: Path, dtype: str, width: int | None = None) -> None:
        self.path, self.dtype, self.width = path, np.dtype(dtype), width
        self.file = open(path, "wb")  # noqa: SIM115 (closed by finish)
        self.crc = 0
        self.length = 0

    def write(self, array: np.ndarray) -> None:
        if not array.size:  # no bytes (no rows, or rows of no columns)
            self.length += array.shape[0]
            return
        data = np.ascontiguousarray(array, dtype=self.dtype.newbyteorder("<")).data.cast("B")
        self.file.write(data)
        self.crc = zlib.crc32(data, self.crc)
        self.length += array.shape[0]

    def finish(self) -> dict[str, Any]:
        self.file.close()  # no fsync: a torn write fails the CRC-32 and is rebuilt
        shape = [self.length] if self.width is None else [self.length, self.width]
        return {"file": self.path.name, "dtype": self.dtype.str, "shape": shape,
                "crc32": self.crc}


@dataclass(frozen=True, slots=True)
class FileColumns:
    """One cached file's columns, memory-mapped: ``labels`` (N,), ``dense`` (N, D), the ids
    of the features whose every sample holds one id as one row-major (N, F) array (a random
    row is one read), and the other features' ids with their offsets (N + 1,)."""

    rows: int
    labels: np.ndarray
    dense: np.ndarray
    ids: np.ndarray  # (N, features with one id a sample), row-major
    one_id: list[str]
    values: dict[str, np.ndarray]  # the other features' ids, with their offsets
    offsets: dict[str, np.ndarray]

    @classmethod
    def open(cls, entry: Path, manifest: dict[str, Any]) -> FileColumns:
        arrays = {name: _mapped(entry / a["file"], a) for name, a in manifest["arrays"].items()}
        one_id = list(manifest["one_id"])
        others = [(i, f) for i, f in enumerate(manifest["sparse"]) if f not in one_id]
        return cls(rows=int(manifest["rows"]), labels=arrays["labels"], dense=arrays["dense"],
                   ids=arrays.get("ids", np.zeros((int(manifest["rows"]), 0), np.uint64)),
                   one_id=one_id, values={f: arrays[f"values{i}"] for i, f in others},
                   offsets={f: arrays[f"offsets{i}"] for i, f in others})

    def take(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict[str, Jagged]]:
        """Labels, dense rows and sparse features of rows ``idx`` (int64), in that order."""
        ids = self.ids[idx]
        ones = np.ones(idx.shape[0], np.int32)
        sparse = {name: Jagged(ids[:, k].copy(), ones) for k, name in enumerate(self.one_id)}
        for name, values in self.values.items():
            offsets = self.offsets[name]
            starts = offsets[idx]
            lengths = (offsets[idx + 1] - starts).astype(np.int32)
            ends = np.cumsum(lengths, dtype=np.int64)
            gather = np.repeat(starts - (ends - lengths), lengths) + np.arange(
                int(ends[-1]) if ends.size else 0, dtype=np.int64)
            sparse[name] = Jagged(values[gather], lengths)
        return self.labels[idx], self.dense[idx], sparse


class ColumnCache:
    """The cache under ``root``: :meth:`prepare` gives a source's :class:`CachedData`,
    parsing (with ``threads`` parser threads) only the files with no valid entry."""

    def __init__(self, root: str | Path | None = None, *, threads: int | None = None) -> None:
        self.root = Path(root) if root is not None else default_cache_dir()
        self.threads = threads or min(4, os.cpu_count() or 1)

    def prepare(self, spec_text: str, *, progress: Callable[[int, int], None] | None = None,
                config: LoaderConfig | None = None) -> CachedData:
        """Every file of ``spec_text`` (a file source) cached and checked; ``progress(done,
        total)`` gets bytes of source parsed so far. A ConfigError for a source that is no
        file source."""
        spec = SourceSpec.parse(spec_text)
        if not spec.kind.is_file:
            raise ConfigError(f"only file sources can be cached, got {spec.kind.value}: "
                              f"{spec_text!r}")
        config = config or LoaderConfig(source=spec_text)
        source = FileSource(spec, config)
        source.resolve()
        parse = {"version": CACHE_VERSION, "kind": spec.kind.value,
                 "parse": source.parse_settings()}
        sizes = [os.stat(p).st_size for p in source.files]
        done, total = 0, sum(sizes)
        entries, built, started = [], 0, time.perf_counter()
        for path, size in zip(source.files, sizes, strict=True):
            identity = _identity(path)
            entry = self.root / hashlib.sha256(json.dumps(
                {**parse, "path": identity["path"]}, sort_keys=True).encode()).hexdigest()[:32]
            if self._valid(entry, identity, parse) is None:
                def parsed(n: int, base: int = done) -> None:
                    if progress is not None:
                        progress(base + n, total)
                self._build(entry, source, path, identity, parse, parsed)
                built += 1
            done += size
            if progress is not None:
                progress(done, total)
            entries.append(str(entry))
        return CachedData(entries=entries, features=list(source.schema.sparse),
                          dense=list(source.schema.dense), built=built,
                          seconds=time.perf_counter() - started)

    def _valid(self, entry: Path, identity: dict[str, Any], parse: dict[str, Any]
               ) -> dict[str, Any] | None:
        """The entry's manifest if it is this file's, unchanged and intact; else None (and a
        log line saying why)."""
        try:
            manifest = json.loads((entry / MANIFEST).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("column cache %s: unreadable manifest (%s): rebuilding", entry, exc)
            return None
        if not isinstance(manifest, dict) or manifest.get("parse") != parse:
            log.warning("column cache %s: made by other settings: rebuilding", entry)
            return None
        if manifest.get("source") != identity:
            log.info("column cache %s: %s changed since it was cached: rebuilding", entry,
                     identity["path"])
            return None
        try:
            return manifest if self._intact(entry, manifest) else None
        except (KeyError, TypeError, ValueError) as exc:  # a manifest of the wrong shape
            log.warning("column cache %s: malformed manifest (%s): rebuilding", entry, exc)
            return None

    @staticmethod
    def _intact(entry: Path, manifest: dict[str, Any]) -> bool:
        for name, array in manifest.get("arrays", {}).items():
            path = entry / str(array.get("file", ""))
            want = int(np.prod(array["shape"])) * np.dtype(array["dtype"]).itemsize
            if not path.is_file() or path.stat().st_size != want or _crc_of(path) != array["crc32"]:
                log.warning("column cache %s: column %s is corrupt (size or CRC-32): "
                            "rebuilding", entry, name)
                return False
        return bool(manifest.get("arrays"))

    def _build(self, entry: Path, source: FileSource, path: str, identity: dict[str, Any],
               parse: dict[str, Any], progress: Callable[[int], None]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=self.root))
        try:
            manifest = _write_columns(tmp, source, path, self.threads, progress)
            manifest.update(parse=parse, source=identity)
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
            shutil.rmtree(entry, ignore_errors=True)
            os.replace(tmp, entry)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log.info("column cache: %s parsed once into %s (%d rows, %d malformed)", path, entry,
                 manifest["rows"], manifest["malformed"])


def _write_columns(out: Path, source: FileSource, path: str, threads: int,
                   progress: Callable[[int], None]) -> dict[str, Any]:
    """Parse ``path`` into column files under ``out``; returns the manifest's arrays part.
    A feature's offsets are written from the first sample that holds other than one id
    (those before it each held one)."""
    names = list(source.schema.sparse)
    labels = _ArrayWriter(out / "labels.bin", "float32")
    dense = _ArrayWriter(out / "dense.bin", "float32", len(source.schema.dense))
    values = [_ArrayWriter(out / f"values{i}.bin", "uint64") for i in range(len(names))]
    offsets: list[_ArrayWriter | None] = [None] * len(names)
    ends = np.zeros(len(names), dtype=np.int64)
    rows = malformed = 0
    with ThreadPoolExecutor(threads, thread_name_prefix="cache-parse") as pool:
        for block, read in source.file_blocks(path, pool):
            malformed += len(block.bad)
            labels.write(block.labels)
            dense.write(block.dense)
            for i, name in enumerate(names):
                feature = block.sparse[name]
                values[i].write(feature.values)
                writer = offsets[i]
                if writer is None and not np.all(feature.lengths == 1):
                    writer = offsets[i] = _ArrayWriter(out / f"offsets{i}.bin", "int64")
                    writer.write(np.arange(rows + 1, dtype=np.int64))
                if writer is not None:
                    writer.write(ends[i] + np.cumsum(feature.lengths, dtype=np.int64))
                ends[i] += feature.values.shape[0]
            rows += block.size
            progress(read)
    arrays = {"labels": labels.finish(), "dense": dense.finish()}
    for i, writer in enumerate(offsets):
        arrays[f"values{i}"] = values[i].finish()
        if writer is not None:
            arrays[f"offsets{i}"] = writer.finish()
    one_id = [i for i, writer in enumerate(offsets) if writer is None]
    if one_id:  # their ids row by row: a sample's ids are one read, not one per feature
        arrays["ids"] = _rows_of(out, [values[i].path for i in one_id], rows)
        for i in one_id:
            del arrays[f"values{i}"]
            values[i].path.unlink()
    return {"rows": rows, "malformed": malformed, "sparse": names,
            "one_id": [names[i] for i in one_id], "dense": list(source.schema.dense),
            "arrays": arrays}


def _rows_of(out: Path, columns: list[Path], rows: int) -> dict[str, Any]:
    """The id columns ``columns`` (uint64, ``rows`` each) as one (rows, len(columns))
    row-major array file."""
    writer = _ArrayWriter(out / "ids.bin", "uint64", len(columns))
    mapped = [np.memmap(c, dtype="<u8", mode="r", shape=(rows,)) if rows else
              np.zeros(0, np.uint64) for c in columns]
    step = 1 << 18
    for start in range(0, rows, step):
        writer.write(np.stack([m[start:start + step] for m in mapped], axis=1))
    del mapped
    return writer.finish()


@dataclass(frozen=True, slots=True)
class CachedData:
    """A cached file source as a trainer reads it: see the module docstring. ``built`` files
    were parsed by :meth:`ColumnCache.prepare` (the others were cached already) in
    ``seconds``."""

    entries: list[str]
    features: list[str]
    dense: list[str]
    built: int = 0
    seconds: float = 0.0
    window: tuple[int, int] | None = None  # rows [start, stop) of the files end to end

    def open(self) -> list[FileColumns]:
        out = []
        for entry in self.entries:
            manifest = json.loads((Path(entry) / MANIFEST).read_text())
            out.append(FileColumns.open(Path(entry), manifest))
        return out

    @property
    def rows(self) -> int:
        total = sum(f.rows for f in self.open())
        start, stop = self.window or (0, total)
        return min(stop, total) - start

    def split_last(self, fraction: float) -> tuple[CachedData, CachedData]:
        """(the first rows, the last ``fraction`` of the rows) in the files' order, end to
        end: for time-ordered files, the past and the latest slice. ConfigError when
        ``fraction`` is not in (0, 1) or leaves either part empty."""
        total = self.rows
        held = round(total * fraction) if 0 < fraction < 1 else 0
        if not 0 < held < total:
            raise ConfigError(f"a validation fraction of {fraction} of {total} rows leaves "
                              "no training or no validation rows")
        start = (self.window or (0, total))[0]
        cut = start + total - held
        return (replace(self, window=(start, cut)),
                replace(self, window=(cut, start + total), built=0, seconds=0.0))

    def describe(self) -> dict[str, Any]:
        """What the summary says of it: files, rows, files parsed now, seconds spent."""
        return {"files": len(self.entries), "rows": self.rows, "parsed_now": self.built,
                "prepare_s": round(self.seconds, 3)}

    def batches(self, batch_size: int, *, rank: int = 0, world: int = 1, epochs: int = 1,
                seed: int | None = 0) -> Iterator[Batch]:
        """Rank ``rank``'s batches: every ``world``-th of ``batch_size`` rows, ``epochs``
        times; ``seed`` None keeps the files' order, else each epoch is shuffled by it."""
        if batch_size < 1 or not 0 <= rank < world or epochs < 1:
            raise ConfigError(f"bad batches({batch_size}, rank={rank}, world={world}, "
                              f"epochs={epochs})")
        files = self.open()
        number = 0
        for epoch in range(epochs):
            for file, idx in _epoch_order(files, seed, epoch, batch_size, self.window):
                if number % world == rank:
                    yield _batch(number, [(files[f], i) for f, i in zip(file, idx, strict=True)])
                number += 1

    def share(self, batch_size: int, *, epochs: int = 1, seed: int | None = 0) -> CachedShare:
        """These batches as each rank of a job reads them (a :class:`RankBatches`)."""
        return CachedShare(self, batch_size, epochs, seed)


@dataclass(frozen=True, slots=True)
class CachedShare:
    """:meth:`CachedData.batches` of one batch size, epochs and seed, for any rank: a
    :class:`~services.common.batch.RankBatches`."""

    data: CachedData
    batch_size: int
    epochs: int = 1
    seed: int | None = 0

    def for_rank(self, rank: int, world: int) -> AsyncIterator[Batch]:
        return self._ahead(rank, world)

    async def _ahead(self, rank: int, world: int) -> AsyncIterator[Batch]:
        """The rank's batches cut in a thread, a few at a time: the event loop stays free."""
        it = self.data.batches(self.batch_size, rank=rank, world=world, epochs=self.epochs,
                               seed=self.seed)
        while chunk := await asyncio.to_thread(lambda: [b for _, b in zip(
                range(_BATCHES_PER_HOP), it, strict=False)]):
            for batch in chunk:
                yield batch


def _file_ranges(files: list[FileColumns], window: tuple[int, int] | None
                 ) -> list[tuple[int, int]]:
    """Each file's rows [start, stop) inside ``window`` (rows of the files end to end)."""
    if window is None:
        return [(0, f.rows) for f in files]
    out, first = [], 0
    for f in files:
        start = min(max(window[0] - first, 0), f.rows)
        out.append((start, max(min(window[1] - first, f.rows), start)))
        first += f.rows
    return out


def _epoch_order(files: list[FileColumns], seed: int | None, epoch: int, batch_size: int,
                 window: tuple[int, int] | None = None
                 ) -> Iterator[tuple[list[int], list[np.ndarray]]]:
    """Each batch as (file numbers, row indices in each): files in a seeded order, each
    file's rows (those in ``window``) permuted, batches running on across file ends."""
    rng = None if seed is None else np.random.default_rng([seed, epoch])
    order = range(len(files)) if rng is None else rng.permutation(len(files))
    ranges = _file_ranges(files, window)
    held: list[tuple[int, np.ndarray]] = []
    room = batch_size
    for f in order:
        low, high = ranges[f]
        n = high - low
        rows = low + (np.arange(n, dtype=np.int64) if rng is None else rng.permutation(n))
        start = 0
        while start < n:
            take = rows[start:start + room]
            held.append((int(f), take))
            start += take.shape[0]
            room -= take.shape[0]
            if room == 0:
                yield [h[0] for h in held], [h[1] for h in held]
                held, room = [], batch_size
    if held:
        yield [h[0] for h in held], [h[1] for h in held]


def _batch(number: int, parts: list[tuple[FileColumns, np.ndarray]]) -> Batch:
    taken = [file.take(idx) for file, idx in parts]
    if len(taken) == 1:
        labels, dense, sparse = taken[0]
    else:
        labels = np.concatenate([t[0] for t in taken])
        dense = np.concatenate([t[1] for t in taken])
        sparse = {name: Jagged(np.concatenate([t[2][name].values for t in taken]),
                               np.concatenate([t[2][name].lengths for t in taken]))
                  for name in taken[0][2]}
    return Batch(batch_id=number, labels=np.asarray(labels), dense=np.asarray(dense),
                 sparse=sparse)

