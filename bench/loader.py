"""``persimmon bench loader``: Criteo parse + hash + batch rows/s against a baseline, one run.

Both sides turn the same generated Criteo-format file (label, 13 integer and 26 hex
categorical columns, ~5% empty fields) into batches of 4096 rows: float labels, float dense
features (missing → NaN → 0, log1p), and one uint64 id per categorical value (empty → none).

- persimmon: :class:`~services.loader.parsers.TextParser` (one numba pass: split, parse,
  hash) over 4 MiB blocks, then :class:`~services.loader.batching.Batcher` and ``Batch``.
- baselines: ``pandas.read_csv`` + per-column ``pd.util.hash_array`` (ratio ``vs_pandas``, the
  headline when pandas is installed); the Python ``csv`` module + per-column numpy conversion
  + the same vectorised hash kernel per column (``vs_csv_module``, the headline without
  pandas); ``pyarrow.csv`` + per-column hashing of the Arrow buffers (``vs_pyarrow``).

Every side runs ``--repeat`` times; the best time counts. Single-threaded where it matters:
pyarrow uses its own threads.
"""

from __future__ import annotations

import argparse
import csv
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
from rich.console import Console
from rich.table import Table

from bench import write_json
from services.common.batch import Jagged
from services.common.commands import int_at_least
from services.loader.arrow import hash_column
from services.loader.batching import Batcher, Rows
from services.loader.hashing import DenseTransform, hash_strings
from services.loader.parsers import TextParser
from services.loader.planted import TeacherRows, format_criteo
from services.loader.schema import criteo_layout
from services.loader.sources.files import read_text_blocks

__all__ = ["register_bench", "run", "write_criteo_file"]

BATCH = 4096
DENSE, SPARSE = 13, 26
DENSE_NAMES = [f"I{i + 1}" for i in range(DENSE)]
SPARSE_NAMES = [f"C{i + 1}" for i in range(SPARSE)]
console = Console(stderr=True)


def write_criteo_file(path: str | Path, rows: int, seed: int = 0,
                      missing: float = 0.05) -> int:
    """A Criteo-format file of ``rows`` random rows; returns its size in bytes."""
    rng = np.random.default_rng(seed)
    with open(path, "wb") as fh:
        for start in range(0, rows, 65536):
            n = min(65536, rows - start)
            raw = {}
            for name in SPARSE_NAMES:
                lengths = (rng.random(n) >= missing).astype(np.int32)
                values = rng.integers(0, 2**32, int(lengths.sum()), dtype=np.uint64)
                raw[name] = Jagged(values, lengths)
            counts = np.floor(np.exp(rng.normal(1.5, 1.5, (n, DENSE)))).astype(np.int64)
            unused = np.zeros(n)
            fh.write(format_criteo(TeacherRows(
                labels=(rng.random(n) < 0.25).astype(np.float32), dense_counts=counts,
                raw_ids=raw, first_order=unused, interaction=unused, dense_term=unused,
                probs=unused)))
    return os.path.getsize(path)


def _batches(rows: Rows, batcher: Batcher, sink: list[int]) -> None:
    for b in batcher.push(rows):
        sink.append(b.to_batch(len(sink), lambda _: "bench").size)


def persimmon_pipeline(path: str) -> int:
    """File → parsed, hashed rows → batches; returns the rows batched."""
    parser = TextParser(criteo_layout(DENSE, SPARSE))
    batcher = Batcher(BATCH)
    sizes: list[int] = []
    for kind, data, _ in read_text_blocks(path, 4 << 20):
        if kind != "lines":
            continue
        p = parser.parse(data)
        _batches(Rows(p.labels, p.dense, p.sparse, p.lines, np.zeros(p.size, np.int64)),
                 batcher, sizes)
    sizes += [b.size for b in batcher.flush()[0]]
    return sum(sizes)


def _rows_from_columns(labels: np.ndarray, dense: np.ndarray,
                       sparse: dict[str, Jagged]) -> Rows:
    n = labels.shape[0]
    return Rows(labels.astype(np.float32), DenseTransform().apply(dense), sparse,
                np.arange(n), np.zeros(n, np.int64))


def csv_module_pipeline(path: str) -> int:
    """The csv module reads rows; numpy converts each column; the same hash kernel hashes
    each categorical column; then the same batcher."""
    with open(path, newline="") as fh:
        columns = list(zip(*csv.reader(fh, delimiter="\t"), strict=True))
    labels = np.array(columns[0], dtype=np.float64)
    dense = np.empty((labels.shape[0], DENSE))
    for d in range(DENSE):
        text = np.array(columns[1 + d])
        dense[:, d] = np.where(text == "", "nan", text).astype(np.float64)
    sparse = {}
    for f, name in enumerate(SPARSE_NAMES):
        col = columns[1 + DENSE + f]
        lengths = np.fromiter(map(len, col), dtype=np.int64, count=len(col))
        offsets = np.zeros(len(col) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        hashes = hash_strings(np.frombuffer("".join(col).encode(), np.uint8), offsets, name)
        present = lengths > 0
        sparse[name] = Jagged(hashes[present], present.astype(np.int32))
    sizes: list[int] = []
    batcher = Batcher(BATCH)
    _batches(_rows_from_columns(labels, dense, sparse), batcher, sizes)
    return sum(sizes) + sum(b.size for b in batcher.flush()[0])


def pandas_pipeline(path: str) -> int:
    """pandas.read_csv, then ``pd.util.hash_array`` per categorical column, same batcher."""
    import pandas as pd

    frame = pd.read_csv(path, sep="\t", header=None,
                        names=["label", *DENSE_NAMES, *SPARSE_NAMES],
                        dtype={n: "string" for n in SPARSE_NAMES})
    sparse = {}
    for name in SPARSE_NAMES:
        col = frame[name]
        present = col.notna().to_numpy()
        hashes = pd.util.hash_array(col[present].to_numpy(dtype=object), categorize=False)
        sparse[name] = Jagged(hashes.astype(np.uint64), present.astype(np.int32))
    sizes: list[int] = []
    batcher = Batcher(BATCH)
    _batches(_rows_from_columns(frame["label"].to_numpy(np.float64),
                                frame[DENSE_NAMES].to_numpy(np.float64), sparse), batcher, sizes)
    return sum(sizes) + sum(b.size for b in batcher.flush()[0])


def pyarrow_pipeline(path: str) -> int:
    """pyarrow.csv (typed columns), then per-column hashing of the Arrow string buffers."""
    types = {"label": pa.float64(), **{n: pa.float64() for n in DENSE_NAMES},
             **{n: pa.binary() for n in SPARSE_NAMES}}
    table = pacsv.read_csv(path, read_options=pacsv.ReadOptions(
        column_names=["label", *DENSE_NAMES, *SPARSE_NAMES]),
        parse_options=pacsv.ParseOptions(delimiter="\t"),
        convert_options=pacsv.ConvertOptions(column_types=types))
    sparse = {name: hash_column(table.column(name), name) for name in SPARSE_NAMES}
    dense = np.column_stack([table.column(n).to_numpy() for n in DENSE_NAMES])
    sizes: list[int] = []
    batcher = Batcher(BATCH)
    _batches(_rows_from_columns(table.column("label").to_numpy(), dense, sparse), batcher, sizes)
    return sum(sizes) + sum(b.size for b in batcher.flush()[0])


def _best(fn: Callable[[str], int], path: str, repeat: int, rows: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        got = fn(path)
        best = min(best, time.perf_counter() - start)
        if got != rows:
            raise RuntimeError(f"{fn.__name__} batched {got} rows, expected {rows}")
    return best


def run(*, rows: int = 200_000, repeat: int = 3, workdir: str | None = None) -> dict[str, Any]:
    """Time every pipeline on one generated file; the headline ratio is against pandas when
    it is installed (``vs_pandas``), else against the csv module (``vs_csv_module``)."""
    try:
        import pandas  # noqa: F401

        have_pandas = True
    except ImportError:
        have_pandas = False
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        path = str(Path(tmp) / "criteo.txt")
        size = write_criteo_file(path, rows)
        console.log(f"{rows:,} Criteo rows, {size / 2**20:.1f} MiB; best of {repeat}")
        persimmon_pipeline(path)  # warm-up: numba kernels compiled or loaded from cache
        times = {"persimmon": _best(persimmon_pipeline, path, repeat, rows),
                 "csv_module": _best(csv_module_pipeline, path, repeat, rows),
                 "pyarrow": _best(pyarrow_pipeline, path, repeat, rows)}
        if have_pandas:
            times["pandas"] = _best(pandas_pipeline, path, repeat, rows)
    headline = "pandas" if have_pandas else "csv_module"
    result: dict[str, Any] = {
        "rows": rows, "file_bytes": size, "batch_size": BATCH, "headline_baseline": headline,
        "baseline": "pandas.read_csv + per-column hash_array" if have_pandas
        else "csv module + per-column hashing",
        **{f"{name}_rows_per_s": rows / t for name, t in times.items()},
        "vs_csv_module": times["csv_module"] / times["persimmon"],
        "vs_pyarrow": times["pyarrow"] / times["persimmon"], "goal": 2.0}
    if have_pandas:
        result["vs_pandas"] = times["pandas"] / times["persimmon"]
    _print_table(result)
    return result


def _print_table(r: dict[str, Any]) -> None:
    table = Table(title="persimmon bench loader: Criteo parse + hash + batch "
                        f"({r['rows']:,} rows, batches of {r['batch_size']})")
    for col in ("pipeline", "rows/s", "MiB/s", "persimmon is", "goal"):
        table.add_column(col, justify="left" if col == "pipeline" else "right")
    mib = r["file_bytes"] / r["rows"] / 2**20
    labels = {"persimmon": "persimmon (numba one-pass parser)",
              "pandas": "pandas.read_csv + per-column hash_array",
              "csv_module": "csv module + per-column hashing",
              "pyarrow": "pyarrow.csv + per-column hashing"}
    for name, label in labels.items():
        if f"{name}_rows_per_s" not in r:
            continue
        speed = r[f"{name}_rows_per_s"]
        ratio = "" if name == "persimmon" else f"vs_{name} = {r[f'vs_{name}']:.1f}x"
        goal = ">= 2" if name == r["headline_baseline"] else ""
        table.add_row(label, f"{speed:,.0f}", f"{speed * mib:,.0f}", ratio, goal)
    Console().print(table)


def _main(args: argparse.Namespace) -> int:
    if args.source == "kafka":
        from bench import loader_kafka

        result = loader_kafka.main(args)
        loader_kafka.show(result)
    else:
        result = run(rows=args.rows or 200_000, repeat=args.repeat)
    write_json(result, args.json)
    return 0


def register_bench(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("loader", help="Criteo parse + hash + batch rows/s")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--source", choices=["file", "kafka"], default="file",
                        help="file: parse + hash + batch a file against pandas/csv/pyarrow; "
                             "kafka: the Kafka source against aiokafka (bench/loader_kafka.py)")
    parser.add_argument("--rows", type=int_at_least(1),
                        help="rows in the generated file (default 200,000), records in the "
                             "topic (default 60,000)")
    parser.add_argument("--repeat", type=int_at_least(1), default=3,
                        help="runs per pipeline (file: best counts; kafka: medians)")
    parser.set_defaults(func=_main)
