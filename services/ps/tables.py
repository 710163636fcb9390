"""Embedding table configuration and the deterministic initial rows.

A table is described by :class:`TableConfig` (with a nested :class:`OptimizerConfig`); both
validate themselves on construction and raise :class:`~services.common.errors.ConfigError`.
:func:`initial_rows` is the one definition of a row before any gradient: a counter-based hash
of (table seed, id, column) turned into a uniform, normal (Box–Muller) or zero value, so a row
created twice, or evicted and created again, is bit-identical.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, TypeVar

import msgspec
import numpy as np
from numba import njit

from services.common.codecs.quant import ONEBIT_EMBEDDING_REFUSAL
from services.common.config import config_to_dict
from services.common.errors import ConfigError
from services.common.messages import TableInfo
from services.ps.hashtable import GOLDEN, mix64, mix64_int, to_unit

__all__ = [
    "EvictionPolicy",
    "Initializer",
    "OptimizerConfig",
    "OptimizerKind",
    "StorageConfig",
    "StorageTier",
    "TableConfig",
    "admission_uniform",
    "initial_rows",
    "table_info",
]

NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_DIM = 4096
STORAGE_DTYPES = ("float32", "float16")
E = TypeVar("E", bound=StrEnum)
_ADMIT_SALT = 0xA5A5_3C3C_5A5A_C3C3
_MASK64 = (1 << 64) - 1


class Initializer(StrEnum):
    UNIFORM = "uniform"
    NORMAL = "normal"
    ZEROS = "zeros"


class OptimizerKind(StrEnum):
    SGD = "sgd"
    ADAGRAD = "adagrad"
    ROWWISE_ADAGRAD = "rowwise_adagrad"
    ADAM = "adam"
    FTRL = "ftrl"


class EvictionPolicy(StrEnum):
    LRU = "lru"
    LFU = "lfu"


class StorageTier(StrEnum):
    RAM = "ram"
    DISK = "disk"


def _enum(cls: type[E], value: Any, where: str) -> E:
    try:
        return cls(value)
    except ValueError as exc:
        raise ConfigError(f"{where}: {value!r} is not one of {[m.value for m in cls]}") from exc


def _number(value: object, where: str, *, low: float | None = None, high: float | None = None,
            low_open: bool = False, high_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where} must be a number, got {value!r}")
    x = float(value)
    if not math.isfinite(x):
        raise ConfigError(f"{where} must be finite, got {value!r}")
    if low is not None and (x < low or (low_open and x == low)):
        raise ConfigError(f"{where} must be {'>' if low_open else '>='} {low}, got {value!r}")
    if high is not None and (x > high or (high_open and x == high)):
        raise ConfigError(f"{where} must be {'<' if high_open else '<='} {high}, got {value!r}")
    return x


def _integer(value: object, where: str, *, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        raise ConfigError(f"{where} must be in [{low}, {high if high is not None else 'inf'}], "
                          f"got {value!r}")
    return int(value)


@dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    """The server-side optimizer of one table.

    ``lr`` is the step size of every kind; for FTRL-Proximal it is ``alpha``, and
    ``ftrl_beta``, ``ftrl_l1``, ``ftrl_l2`` are its other parameters. ``initial_accumulator``
    starts both Adagrads' accumulators (0 makes every element's first step ``±lr`` whatever
    the gradient's size). ``weight_decay`` is L2 added to a pushed row's gradient (not FTRL:
    use ``ftrl_l2``). ``grad_clip`` clips every element of a pushed row's gradient (its
    duplicates summed) to ``[-grad_clip, grad_clip]`` before the update; ``weight_bound``
    clips every updated weight to ``[-weight_bound, weight_bound]``.
    """

    kind: OptimizerKind = OptimizerKind.ADAGRAD
    lr: float = 0.01
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999
    initial_accumulator: float = 0.0
    weight_decay: float = 0.0
    ftrl_beta: float = 1.0
    ftrl_l1: float = 0.0
    ftrl_l2: float = 0.0
    weight_bound: float | None = None
    grad_clip: float | None = None

    def __post_init__(self) -> None:
        if str(getattr(self.kind, "value", self.kind)).startswith("onebit"):
            raise ConfigError(f"optimizer.kind {self.kind!r}: {ONEBIT_EMBEDDING_REFUSAL}")
        self.kind = _enum(OptimizerKind, self.kind, "optimizer.kind")
        self.lr = _number(self.lr, "optimizer.lr", low=0.0,
                          low_open=self.kind is OptimizerKind.FTRL)
        self.eps = _number(self.eps, "optimizer.eps", low=0.0, low_open=True)
        self.beta1 = _number(self.beta1, "optimizer.beta1", low=0.0, high=1.0, high_open=True)
        self.beta2 = _number(self.beta2, "optimizer.beta2", low=0.0, high=1.0, high_open=True)
        self.initial_accumulator = _number(self.initial_accumulator,
                                           "optimizer.initial_accumulator", low=0.0)
        self.weight_decay = _number(self.weight_decay, "optimizer.weight_decay", low=0.0)
        if self.weight_decay and self.kind is OptimizerKind.FTRL:
            raise ConfigError("optimizer.weight_decay does not apply to ftrl: set ftrl_l2")
        self.ftrl_beta = _number(self.ftrl_beta, "optimizer.ftrl_beta", low=0.0, low_open=True)
        self.ftrl_l1 = _number(self.ftrl_l1, "optimizer.ftrl_l1", low=0.0)
        self.ftrl_l2 = _number(self.ftrl_l2, "optimizer.ftrl_l2", low=0.0)
        if self.weight_bound is not None:
            self.weight_bound = _number(self.weight_bound, "optimizer.weight_bound",
                                        low=0.0, low_open=True)
        if self.grad_clip is not None:
            self.grad_clip = _number(self.grad_clip, "optimizer.grad_clip", low=0.0,
                                     low_open=True)


@dataclass(kw_only=True, slots=True)
class StorageConfig:
    """Where a table's rows live: all in RAM, or (``tier: disk``) at most about ``ram_rows``
    in RAM and the colder rows in a scratch arena file under the directory ``path``."""

    tier: StorageTier = StorageTier.RAM
    path: str | None = None
    ram_rows: int | None = None

    def __post_init__(self) -> None:
        self.tier = _enum(StorageTier, self.tier, "storage.tier")
        if self.tier is StorageTier.RAM:
            if self.path is not None or self.ram_rows is not None:
                raise ConfigError("storage: path and ram_rows apply to tier disk only")
            return
        if not isinstance(self.path, str) or not self.path:
            raise ConfigError(f"storage.path: tier disk needs a directory, got {self.path!r}")
        if self.ram_rows is None:
            raise ConfigError("storage.ram_rows: tier disk needs the number of rows kept in RAM")
        self.ram_rows = _integer(self.ram_rows, "storage.ram_rows", low=1)


@dataclass(kw_only=True, slots=True)
class TableConfig:
    """One embedding table: shape, storage, initializer, optimizer, admission and capacity.

    Admission: an id gets a row at its ``admit_min_count``-th sighting (lookups and pushes,
    each call counts once per id; 0 and 1 admit at once) and, when ``admit_probability`` < 1,
    only if a seeded draw for that sighting passes. ``max_rows`` bounds the live rows with
    ``eviction`` (LRU/LFU) over both storage tiers; ``ttl_s`` drops rows untouched that long
    when ``expire()`` runs. ``storage`` puts cold rows on disk (:class:`StorageConfig`).
    """

    name: str
    dim: int
    dtype: str = "float32"
    initializer: Initializer = Initializer.UNIFORM
    init_low: float = -0.01
    init_high: float = 0.01
    init_std: float = 0.01
    seed: int = 0
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    admit_probability: float = 1.0
    admit_min_count: int = 0
    max_rows: int | None = None
    eviction: EvictionPolicy = EvictionPolicy.LRU
    ttl_s: float | None = None
    initial_capacity: int = 1024
    storage: StorageConfig = field(default_factory=StorageConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not NAME_RE.fullmatch(self.name):
            raise ConfigError(f"table name must match [A-Za-z0-9_.-]{{1,64}}, got {self.name!r}")
        self.dim = _integer(self.dim, f"table {self.name}: dim", low=1, high=MAX_DIM)
        if self.dtype not in STORAGE_DTYPES:
            raise ConfigError(f"table {self.name}: dtype must be one of {STORAGE_DTYPES}, "
                              f"got {self.dtype!r}")
        self.initializer = _enum(Initializer, self.initializer, f"table {self.name}: initializer")
        self.init_low = _number(self.init_low, f"table {self.name}: init_low")
        self.init_high = _number(self.init_high, f"table {self.name}: init_high")
        if self.init_low > self.init_high:
            raise ConfigError(f"table {self.name}: init_low ({self.init_low}) must be <= "
                              f"init_high ({self.init_high})")
        self.init_std = _number(self.init_std, f"table {self.name}: init_std", low=0.0)
        self.seed = _integer(self.seed, f"table {self.name}: seed", low=0, high=2**64 - 1)
        if isinstance(self.optimizer, dict):
            self.optimizer = OptimizerConfig(**self.optimizer)
        if not isinstance(self.optimizer, OptimizerConfig):
            raise ConfigError(f"table {self.name}: optimizer must be an OptimizerConfig, "
                              f"got {self.optimizer!r}")
        self.admit_probability = _number(self.admit_probability,
                                         f"table {self.name}: admit_probability",
                                         low=0.0, high=1.0, low_open=True)
        self.admit_min_count = _integer(self.admit_min_count,
                                        f"table {self.name}: admit_min_count", low=0)
        if self.max_rows is not None:
            self.max_rows = _integer(self.max_rows, f"table {self.name}: max_rows", low=1)
        self.eviction = _enum(EvictionPolicy, self.eviction, f"table {self.name}: eviction")
        if self.ttl_s is not None:
            self.ttl_s = _number(self.ttl_s, f"table {self.name}: ttl_s", low=0.0, low_open=True)
        self.initial_capacity = _integer(self.initial_capacity,
                                         f"table {self.name}: initial_capacity", low=1,
                                         high=2**31)
        if isinstance(self.storage, dict):
            try:
                self.storage = StorageConfig(**self.storage)
            except TypeError as exc:
                raise ConfigError(f"table {self.name}: storage: {exc}") from exc
        if not isinstance(self.storage, StorageConfig):
            raise ConfigError(f"table {self.name}: storage must be a StorageConfig, "
                              f"got {self.storage!r}")

    @property
    def storage_dtype(self) -> np.dtype:
        """The numpy dtype rows are stored in (optimizer math is always float32)."""
        return np.dtype(self.dtype)

    @property
    def admits_all(self) -> bool:
        """True when every id gets a row at first sight."""
        return self.admit_min_count <= 1 and self.admit_probability >= 1.0

    def optimizer_with(self, changes: dict[str, Any]) -> OptimizerConfig:
        """The optimizer settings with ``changes``, checked: a ConfigError for a bad or
        unknown setting, and for a new kind (its state would not fit)."""
        kind = self.optimizer.kind
        if changes.get("kind", kind) != kind:
            raise ConfigError(f"table {self.name}: the optimizer kind cannot change "
                              f"({kind} -> {changes['kind']})")
        try:
            return replace(self.optimizer, **changes)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"table {self.name}: {exc}") from exc


_INIT_CODES = {Initializer.UNIFORM: 0, Initializer.NORMAL: 1, Initializer.ZEROS: 2}


@njit(cache=True, nogil=True)
def _fill_initial(ids, seed_key, code, low, high, std, out):  # pragma: no cover - numba
    two_pi = 2.0 * np.pi
    for j in range(ids.shape[0]):
        base = mix64(ids[j] ^ seed_key)
        for c in range(out.shape[1]):
            if code == 0:
                u = to_unit(mix64(base + np.uint64(c + 1) * GOLDEN))
                out[j, c] = low + (high - low) * u
            elif code == 1:
                u1 = to_unit(mix64(base + np.uint64(2 * c + 1) * GOLDEN))
                u2 = to_unit(mix64(base + np.uint64(2 * c + 2) * GOLDEN))
                out[j, c] = std * np.sqrt(-2.0 * np.log(1.0 - u1)) * np.cos(two_pi * u2)
            else:
                out[j, c] = 0.0


def _seed_key(seed: int, salt: int = 0) -> np.uint64:
    return np.uint64(mix64_int((seed + int(GOLDEN)) & _MASK64) ^ salt)


def initial_rows(config: TableConfig, ids: np.ndarray) -> np.ndarray:
    """The rows ``ids`` have before any update: float32 ``(n, dim)``, rounded to storage dtype."""
    ids = np.ascontiguousarray(ids, dtype=np.uint64)
    out = np.empty((ids.shape[0], config.dim), dtype=np.float32)
    _fill_initial(ids, _seed_key(config.seed), _INIT_CODES[config.initializer],
                  float(config.init_low), float(config.init_high), float(config.init_std), out)
    if config.storage_dtype != np.float32:
        out = out.astype(config.storage_dtype).astype(np.float32)
    return out


@njit(cache=True, nogil=True)
def _admission_draws(ids, counts, seed_key, out):  # pragma: no cover - numba
    for j in range(ids.shape[0]):
        out[j] = to_unit(mix64(mix64(ids[j] ^ seed_key) + np.uint64(counts[j]) * GOLDEN))


def admission_uniform(config: TableConfig, ids: np.ndarray, sightings: np.ndarray) -> np.ndarray:
    """A uniform [0, 1) draw per (table seed, id, sighting number): the admission coin."""
    out = np.empty(ids.shape[0], dtype=np.float64)
    _admission_draws(np.ascontiguousarray(ids, dtype=np.uint64),
                     np.ascontiguousarray(sightings, dtype=np.int64),
                     _seed_key(config.seed, _ADMIT_SALT), out)
    return out


def table_info(config: TableConfig) -> TableInfo:
    """``config`` as the wire's :class:`~services.common.messages.TableInfo` (Tables replies,
    the WAL's create records, checkpoint manifests)."""
    return msgspec.convert(config_to_dict(config), TableInfo)
