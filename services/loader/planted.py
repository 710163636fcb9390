"""Planted synthetic click data whose best possible AUC and logloss are known.

Each sample has ``num_dense`` count features (feature ``d`` missing with probability
``dense_missing[d]``) and ``len(vocab_sizes)`` categorical features (the last
``num_multi_hot`` of them multi-hot, 1 + Poisson ids each). Ids are Zipf-distributed over each
feature's vocabulary. Two profiles: ``toy`` (the defaults: 8 small vocabularies, learnable at
demo size) and ``criteo`` (:func:`synthetic_profile`: Criteo Kaggle's 26 vocabulary sizes
capped at ``max_vocab``, Zipf 1.1, 13 counts with Criteo's missing rates). The label is drawn
from a known *teacher*::

    logit = bias + Σ_f mean_{i ∈ ids_f} w_f[i]                       (per-id weights)
                 + Σ_{f<g} <mean u_f[ids_f], mean u_g[ids_g]>          (low-rank interactions)
                 + Σ_d β_d (log1p(x_d) − μ)     (dense term; a missing x_d counts as 0)
    label ~ Bernoulli(sigmoid(logit))

so the teacher's own probabilities give the oracle AUC/logloss on a test split. Rows come in
fixed chunks of :data:`CHUNK_ROWS`, each from its own seeded generator: the same seed gives
the same data however it is read. Files are written in Criteo layout (label, dense counts,
categorical ids as 8-digit hex, multi-hot ids joined by ``,``); parsing them with
``criteo_layout(num_dense, num_sparse, multi_hot=",")`` gives exactly the batches that
:meth:`SyntheticDataset.rows` builds in memory.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numba import njit

from services.common.batch import Batch, Jagged
from services.common.config import config_to_dict
from services.common.errors import ConfigError
from services.common.scoring import auc, logloss
from services.loader.batching import Batcher, Rows
from services.loader.hashing import DenseTransform, hash_hex_ids
from services.loader.schema import TextLayout, criteo_layout

__all__ = ["CHUNK_ROWS", "CRITEO_KAGGLE_VOCAB", "PROFILES", "SyntheticConfig",
           "SyntheticDataset", "TeacherRows", "format_criteo", "synthetic_profile"]

CHUNK_ROWS = 8192
_SPLITS = {"train": 0, "test": 1, "validation": 2}
_DENSE_MU = 1.5
# Distinct values of C1..C26 in Criteo's Kaggle (Display Advertising Challenge) training set
CRITEO_KAGGLE_VOCAB = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683,
                       8351593, 3194, 27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15,
                       286181, 105, 142572)
# Share of empty fields of I1..I13 in that set (rounded)
CRITEO_KAGGLE_DENSE_MISSING = (0.45, 0.0, 0.21, 0.22, 0.03, 0.22, 0.04, 0.0005, 0.04, 0.45,
                               0.04, 0.77, 0.22)
PROFILES = ("toy", "criteo")


@dataclass(kw_only=True, slots=True)
class SyntheticConfig:
    """Shape and strength of the planted data.

    The defaults give an oracle AUC near 0.88, most of it from the ids (the dense term alone
    reaches about 0.69), and are learnable at demo size: DLRM trained on half a million rows
    gets within about 0.004 of the oracle. A heavier tail (e.g. ``zipf_exponent=1.6`` with
    100k-id vocabularies) needs many millions of rows for that, since rare ids are seen too
    seldom to learn their weights."""

    seed: int = 0
    num_dense: int = 4
    vocab_sizes: list[int] = field(
        default_factory=lambda: [100, 200, 500, 1000, 2000, 5000, 10000, 300])
    num_multi_hot: int = 2
    mean_multi_hot_length: float = 3.0
    max_multi_hot_length: int = 8
    zipf_exponent: float = 2.0
    interaction_rank: int = 4
    weight_scale: float = 1.0
    interaction_scale: float = 0.2
    dense_scale: float = 0.5
    bias: float = -1.0
    dense_missing: list[float] = field(default_factory=list)
    center_weights: bool = False  # each feature's mean w and u over its Zipf draws are 0

    def __post_init__(self) -> None:
        if not self.vocab_sizes or any(v < 2 or v > 2**32 for v in self.vocab_sizes):
            raise ConfigError(f"vocab_sizes must be non-empty, each in [2, 2**32], "
                              f"got {self.vocab_sizes}")
        if not 0 <= self.num_multi_hot <= len(self.vocab_sizes):
            raise ConfigError(f"num_multi_hot must be in [0, {len(self.vocab_sizes)}]")
        if self.num_dense < 0 or self.interaction_rank < 1:
            raise ConfigError("num_dense must be >= 0 and interaction_rank >= 1")
        if not 0 < self.zipf_exponent < math.inf:
            raise ConfigError(f"zipf_exponent must be > 0, got {self.zipf_exponent}")
        if not 1.0 <= self.mean_multi_hot_length <= self.max_multi_hot_length:
            raise ConfigError("need 1 <= mean_multi_hot_length <= max_multi_hot_length")
        if self.dense_missing and (len(self.dense_missing) != self.num_dense
                                   or not all(0 <= r < 1 for r in self.dense_missing)):
            raise ConfigError(f"dense_missing must give a rate in [0, 1) for each of the "
                              f"{self.num_dense} dense features, got {self.dense_missing}")
        for name in ("weight_scale", "interaction_scale", "dense_scale"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must be >= 0")

    @property
    def sparse_names(self) -> list[str]:
        return [f"C{i + 1}" for i in range(len(self.vocab_sizes))]


def synthetic_profile(name: str, *, seed: int = 0, max_vocab: int = 1_000_000,
                      zipf: float | None = None) -> SyntheticConfig:
    """The ``toy`` or ``criteo`` planted data set's config.

    ``criteo``: 26 single-hot features with Criteo Kaggle's vocabulary sizes capped at
    ``max_vocab`` (5.6M ids in all at the 1M default), Zipf exponent ``zipf`` (default 1.1),
    13 counts with Criteo's missing rates; teacher weights scaled for 26 features (oracle AUC
    about 0.87 at the defaults, 15-40 % of the labels positive by seed)."""
    if name == "toy":
        toy = SyntheticConfig(seed=seed)
        if zipf is not None:
            toy.zipf_exponent = zipf
            toy.__post_init__()  # validate the changed exponent
        return toy
    if name != "criteo":
        raise ConfigError(f"synthetic profile must be one of {list(PROFILES)}, got {name!r}")
    if max_vocab < 2:
        raise ConfigError(f"max_vocab must be >= 2, got {max_vocab}")
    return SyntheticConfig(
        seed=seed, num_dense=13, vocab_sizes=[min(v, max_vocab) for v in CRITEO_KAGGLE_VOCAB],
        num_multi_hot=0, zipf_exponent=1.1 if zipf is None else zipf,
        weight_scale=0.35, interaction_scale=0.12, dense_scale=0.25, bias=-1.3,
        dense_missing=list(CRITEO_KAGGLE_DENSE_MISSING), center_weights=True)


@dataclass(slots=True)
class TeacherRows:
    """Raw generated rows: raw ids per feature, dense counts, the teacher's terms and labels."""

    labels: np.ndarray
    dense_counts: np.ndarray  # int64; -1 marks a missing value
    raw_ids: dict[str, Jagged]
    first_order: np.ndarray   # (n, num_sparse) each feature's mean per-id weight
    interaction: np.ndarray   # (n,)
    dense_term: np.ndarray    # (n, num_dense)
    probs: np.ndarray

    @property
    def size(self) -> int:
        return int(self.labels.shape[0])

    def teacher_features(self) -> np.ndarray:
        """The teacher's additive terms as columns: a linear model on them can reach the oracle."""
        return np.column_stack([self.first_order, self.interaction, self.dense_term])


class SyntheticDataset:
    """The teacher and the generator; ``rows``/``batches`` in memory, ``write`` to files."""

    def __init__(self, config: SyntheticConfig | None = None) -> None:
        self.config = cfg = config or SyntheticConfig()
        rng = np.random.default_rng([cfg.seed, 99])
        self._cdf = []
        self._perm = []
        self._w = []
        self._u = []
        for v in cfg.vocab_sizes:
            p = np.arange(1, v + 1, dtype=np.float64) ** -cfg.zipf_exponent
            cdf = np.cumsum(p)
            self._cdf.append(cdf / cdf[-1])
            self._perm.append(rng.permutation(v).astype(np.uint64))
            w = rng.normal(0.0, cfg.weight_scale, v)
            u = rng.normal(0.0, cfg.interaction_scale, (v, cfg.interaction_rank))
            if cfg.center_weights:  # the base rate then comes from ``bias``, not the head ids
                p = np.diff(cdf, prepend=0.0) / cdf[-1]
                w -= p @ w
                u -= p @ u
            self._w.append(w)
            self._u.append(u)
        self._beta = rng.normal(0.0, cfg.dense_scale, cfg.num_dense)
        self.layout: TextLayout = criteo_layout(cfg.num_dense, len(cfg.vocab_sizes),
                                                multi_hot=",")
        self.transform = DenseTransform()

    # ---- generation -----------------------------------------------------------------------

    def teacher_chunk(self, split: str, index: int) -> TeacherRows:
        """Chunk ``index`` (``CHUNK_ROWS`` rows) of split ``"train"``, ``"test"`` or
        ``"validation"``."""
        if split not in _SPLITS:
            raise ConfigError(f"split must be one of {sorted(_SPLITS)}, got {split!r}")
        cfg = self.config
        rng = np.random.default_rng([cfg.seed, _SPLITS[split], index])
        n = CHUNK_ROWS
        nsparse = len(cfg.vocab_sizes)
        first = np.empty((n, nsparse))
        pooled = np.zeros((n, cfg.interaction_rank))
        sq_norms = np.zeros(n)
        raw: dict[str, Jagged] = {}
        for f, name in enumerate(cfg.sparse_names):
            if f >= nsparse - cfg.num_multi_hot:
                extra = rng.poisson(cfg.mean_multi_hot_length - 1.0, n)
                lengths = np.minimum(1 + extra, cfg.max_multi_hot_length).astype(np.int32)
            else:
                lengths = np.ones(n, dtype=np.int32)
            ranks = np.searchsorted(self._cdf[f], rng.random(int(lengths.sum())), side="right")
            ranks = np.minimum(ranks, cfg.vocab_sizes[f] - 1)
            rows = np.repeat(np.arange(n), lengths)
            first[:, f] = np.bincount(rows, self._w[f][ranks], minlength=n) / lengths
            emb = np.zeros((n, cfg.interaction_rank))
            np.add.at(emb, rows, self._u[f][ranks])
            emb /= lengths[:, None]
            pooled += emb
            sq_norms += np.einsum("ij,ij->i", emb, emb)
            raw[name] = Jagged(self._perm[f][ranks], lengths)
        interaction = 0.5 * (np.einsum("ij,ij->i", pooled, pooled) - sq_norms)
        counts = np.floor(np.exp(rng.normal(_DENSE_MU, 1.0, (n, cfg.num_dense))))
        if cfg.dense_missing:
            counts[rng.random((n, cfg.num_dense)) < np.asarray(cfg.dense_missing)] = -1
        dense_term = (np.log1p(np.maximum(counts, 0.0)) - _DENSE_MU) * self._beta
        logit = cfg.bias + first.sum(axis=1) + interaction + dense_term.sum(axis=1)
        probs = 1.0 / (1.0 + np.exp(-logit))
        labels = (rng.random(n) < probs).astype(np.float32)
        return TeacherRows(labels=labels, dense_counts=counts.astype(np.int64), raw_ids=raw,
                           first_order=first, interaction=interaction, dense_term=dense_term,
                           probs=probs)

    def teacher_rows(self, split: str, rows: int) -> TeacherRows:
        """The first ``rows`` rows of a split, concatenated."""
        chunks = [self.teacher_chunk(split, k) for k in range(math.ceil(rows / CHUNK_ROWS))]
        cut = [_slice_teacher(c, min(CHUNK_ROWS, rows - k * CHUNK_ROWS))
               for k, c in enumerate(chunks)]
        return TeacherRows(
            labels=np.concatenate([c.labels for c in cut]),
            dense_counts=np.concatenate([c.dense_counts for c in cut]),
            raw_ids={n: Jagged(np.concatenate([c.raw_ids[n].values for c in cut]),
                               np.concatenate([c.raw_ids[n].lengths for c in cut]))
                     for n in self.config.sparse_names},
            first_order=np.concatenate([c.first_order for c in cut]),
            interaction=np.concatenate([c.interaction for c in cut]),
            dense_term=np.concatenate([c.dense_term for c in cut]),
            probs=np.concatenate([c.probs for c in cut]))

    def hashed(self, teacher: TeacherRows, first_position: int = 0, chunk: int = 0) -> Rows:
        """The loader's view of teacher rows: hashed ids and transformed dense features."""
        sparse = {name: Jagged(hash_hex_ids(f.values, name, self.layout.schema.bucket_of(name)),
                               f.lengths) for name, f in teacher.raw_ids.items()}
        n = teacher.size
        counts = teacher.dense_counts.astype(np.float64)
        counts[teacher.dense_counts < 0] = np.nan  # missing, as a parser reads an empty field
        return Rows(labels=teacher.labels, dense=self.transform.apply(counts),
                    sparse=sparse, positions=np.arange(first_position, first_position + n),
                    chunks=np.full(n, chunk, dtype=np.int64))

    def rows(self, split: str, index: int, chunk: int = 0) -> Rows:
        """Chunk ``index`` of a split as loader rows (positions are row numbers)."""
        return self.hashed(self.teacher_chunk(split, index), index * CHUNK_ROWS, chunk)

    def batches(self, batch_size: int, rows: int, split: str = "train",
                shuffle_buffer: int = 0) -> Iterator[Batch]:
        """``rows`` rows as batches, straight from memory (the demo's data path)."""
        batcher = Batcher(batch_size, shuffle_buffer=shuffle_buffer, seed=self.config.seed)
        partition = f"synthetic:{split}"
        next_id = 0
        for k in range(math.ceil(rows / CHUNK_ROWS)):
            part = self.rows(split, k)
            take = min(CHUNK_ROWS, rows - k * CHUNK_ROWS)
            for b in batcher.push(part.slice(0, take) if take < part.size else part):
                yield b.to_batch(next_id, lambda _: partition)
                next_id += 1
        for b in batcher.flush()[0]:
            yield b.to_batch(next_id, lambda _: partition)
            next_id += 1

    # ---- oracle and files ------------------------------------------------------------------

    def oracle(self, test_rows: int) -> dict[str, float]:
        """AUC and logloss of the teacher's true probabilities on the first test rows."""
        t = self.teacher_rows("test", test_rows)
        return {"auc": auc(t.labels, t.probs), "logloss": logloss(t.labels, t.probs),
                "positive_rate": float(t.labels.mean())}

    def write(self, out_dir: str | Path, train_rows: int, test_rows: int) -> dict[str, Any]:
        """Write ``train.txt``, ``test.txt`` (Criteo layout) and ``synthetic.json``: all of
        them or, on any failure, none (nor the directories this call created)."""
        out = Path(out_dir)
        if out.exists() and not out.is_dir():
            raise ConfigError(f"{out} exists and is not a directory")
        top = out  # the outermost directory this call creates, removed on failure
        while not top.parent.exists():
            top = top.parent
        created = not out.exists()
        out.mkdir(parents=True, exist_ok=True)
        names = ("train.txt", "test.txt", "synthetic.json")
        staged = {name: out / f".tmp-{name}" for name in names}
        placed: list[Path] = []
        try:
            meta = self._write_staged(out, staged, train_rows, test_rows)
            for name in names:
                staged[name].replace(out / name)
                placed.append(out / name)
        except BaseException:
            for path in [*staged.values(), *placed]:
                path.unlink(missing_ok=True)
            if created:
                shutil.rmtree(top, ignore_errors=True)
            raise
        return meta

    def _write_staged(self, out: Path, staged: dict[str, Path], train_rows: int,
                      test_rows: int) -> dict[str, Any]:
        for split, rows in (("train", train_rows), ("test", test_rows)):
            with open(staged[f"{split}.txt"], "wb") as fh:
                for k in range(math.ceil(rows / CHUNK_ROWS)):
                    chunk = _slice_teacher(self.teacher_chunk(split, k),
                                           min(CHUNK_ROWS, rows - k * CHUNK_ROWS))
                    fh.write(format_criteo(chunk))
        cfg = self.config
        meta = {
            "seed": cfg.seed, "train_rows": train_rows, "test_rows": test_rows,
            "oracle": self.oracle(test_rows),
            "source": f"criteo:{out / 'train.txt'}?dense={cfg.num_dense}"
                      f"&sparse={len(cfg.vocab_sizes)}&multi_hot=,",
            "test_source": f"criteo:{out / 'test.txt'}?dense={cfg.num_dense}"
                           f"&sparse={len(cfg.vocab_sizes)}&multi_hot=,",
            "config": config_to_dict(cfg),
        }
        staged["synthetic.json"].write_text(json.dumps(meta, indent=2) + "\n")
        return meta


def _slice_teacher(t: TeacherRows, rows: int) -> TeacherRows:
    if rows >= t.size:
        return t
    raw = {}
    for name, f in t.raw_ids.items():
        raw[name] = Jagged(f.values[:int(f.lengths[:rows].sum())], f.lengths[:rows])
    return TeacherRows(labels=t.labels[:rows], dense_counts=t.dense_counts[:rows], raw_ids=raw,
                       first_order=t.first_order[:rows], interaction=t.interaction[:rows],
                       dense_term=t.dense_term[:rows], probs=t.probs[:rows])


@njit(nogil=True, cache=True)
def _format_lines(labels, dense, values_list, lengths_list, out):  # noqa: C901
    hexdig = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
    digits = np.empty(20, dtype=np.uint8)
    cursors = np.zeros(len(values_list), dtype=np.int64)
    w = 0
    for r in range(labels.shape[0]):
        out[w] = 48 + int(labels[r])
        w += 1
        for d in range(dense.shape[1]):
            out[w] = 9
            w += 1
            v = dense[r, d]
            if v < 0:  # missing: an empty field
                continue
            n = 0
            while True:
                digits[n] = 48 + v % 10
                v //= 10
                n += 1
                if v == 0:
                    break
            for k in range(n - 1, -1, -1):
                out[w] = digits[k]
                w += 1
        for f in range(len(values_list)):
            out[w] = 9
            w += 1
            for q in range(lengths_list[f][r]):
                if q:
                    out[w] = 44
                    w += 1
                v = values_list[f][cursors[f]]
                cursors[f] += 1
                for k in range(7, -1, -1):
                    out[w] = hexdig[(v >> np.uint64(4 * k)) & np.uint64(15)]
                    w += 1
        out[w] = 10
        w += 1
    return w


def format_criteo(t: TeacherRows) -> bytes:
    """Criteo-layout lines of teacher rows (raw ids as 8-digit hex, multi-hot joined by ',')."""
    values = [f.values for f in t.raw_ids.values()]
    lengths = [f.lengths for f in t.raw_ids.values()]
    bound = t.size * (2 + t.dense_counts.shape[1] * 21) + sum(9 * v.shape[0] + 1 for v in values) \
        + t.size * len(values)
    out = np.empty(bound, dtype=np.uint8)
    from numba.typed import List

    written = _format_lines(t.labels, t.dense_counts, List(values), List(lengths), out)
    return out[:written].tobytes()
