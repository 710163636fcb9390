"""Configuration of the Trainer (one NN worker): mode, staleness, dense optimizer, codecs.

:class:`TrainerConfig` is the flat, flag- and YAML-friendly form; ``persimmon worker`` and
``persimmon train`` load it with :func:`services.common.config.load_config`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from services.common.codecs import codec_without_feedback, get_codec
from services.common.errors import ConfigError, PersimmonError
from services.worker.compression import HOOK_NAMES, lossy_codec
from services.worker.embedding.exchange import EMBEDDING_PATHS
from services.worker.embedding.window import MAX_AUTO_WINDOW
from services.worker.pooling import POOLING_MODES
from services.worker.sync import STRATEGIES, SyncConfig

__all__ = ["DENSE_OPTIMIZERS", "MODES", "SYNC_FIELDS", "TrainerConfig", "ps_table_configs"]

MODES = ("sync", "global_sync", "hybrid", "async")
DENSE_OPTIMIZERS = ("adam", "adagrad", "sgd", "lamb", "onebit_adam", "onebit_lamb")
# strategies that take no codec (they exchange their own payload, not a flat average)
UNCOMPRESSED_SYNCS = ("gossip", "hierarchical", "sfb", "gadmm")
# the fields that choose the dense sync strategy (``--sync`` and its parameters)
SYNC_FIELDS = ("sync", "sync_period", "sync_group_size", "sync_schedule", "sync_elastic_alpha",
               "gossip_topology", "ranks_per_node", "gadmm_rho")


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    """How one worker trains.

    ``staleness`` S bounds the batches in flight in ``hybrid`` mode (``auto``, the default:
    sized at the start from the measured round trip to the PS,
    :mod:`services.worker.embedding.window`; 1 with the shards in the worker's process): a batch
    takes one of ``max(S, 1)`` semaphore slots before its lookup and frees it when its push is
    acknowledged, so a lookup sees at most ``S - 1`` earlier pushes still unacknowledged
    (never more than S). ``sync`` is S = 0 (one batch at a time, bit-reproducible);
    ``async`` has no bound on pushes (only ``prefetch`` bounds lookups ahead) and no head
    ids. With several workers ``global_bound`` makes S a bound across them: a lookup misses
    at most S pushes of any worker.
    ``global_sync`` is ``sync`` across the workers: after each push is acknowledged every
    worker waits for the others, so every worker's push of step t is applied before any
    worker's lookup of step t + 1 (``sync`` bounds only a worker's own pushes). In ``hybrid``
    mode the *head ids* (seen at least ``head_rate`` times per batch) and the *hot* tables
    (``hot_ratio``: at most that many distinct ids per sample in the first batch; off by
    default, head ids cover them) have the bound ``hot_staleness`` instead, across the workers
    with ``global_hot``: stale updates of rows that every batch touches cost most of hybrid's
    AUC gap to sync (docs/training.md).
    """

    mode: str = field(default="hybrid", metadata={
        "help": "sync, global_sync (sync across the workers), hybrid or async (no staleness "
                "bound)"})
    staleness: int | str = field(default="auto", metadata={
        "help": "hybrid: batches in flight (S), or auto: the smallest window that hides the "
                "measured round trip to the PS (1, none, with the shards in this process)"})
    prefetch: int = field(default=8, metadata={"help": "async: lookups ahead of compute"})
    gil_switch_ms: float = field(default=0.5, metadata={
        "help": "on CPU, Python's GIL switch interval at most this while a fit's compute thread "
                "runs, restored after (Python's default: 5; 0: left as it is)"})
    torch_threads: int = field(default=0, metadata={
        "help": "on CPU, torch's intra-op threads at most this while a fit's compute thread "
                "runs, restored after (0: auto: one fewer than the cores where the shards are in the "
                "worker's process, whose lookups and updates take a core; else torch's own)"})
    hot_ratio: float = field(default=0.0, metadata={
        "help": "hybrid: tables whose first batch has at most this many distinct ids per "
                "sample (hot rows) get hot_staleness instead of staleness (0: none; head ids "
                "cover them on the rows path, e.g. 0.3 for des)"})
    hot_staleness: int = field(default=1, metadata={
        "help": "hybrid: the staleness bound of the hot tables and head ids (1: synchronous; "
                "2 lets one of their pushes be in flight: faster over a network, slightly "
                "less accurate)"})
    global_hot: bool = field(default=True, metadata={
        "help": "hybrid, several workers: every worker's push of a step to the hot tables and "
                "head ids is applied before any worker looks them up for the next step (a "
                "barrier per step)"})
    global_bound: bool = field(default=True, metadata={
        "help": "sync and hybrid, several workers: no worker starts a step before every worker "
                "holds its slot of the step before, so no lookup misses more than S pushes of "
                "any worker (stale synchronous parallel; false: S bounds each worker's own "
                "pushes only, and workers that sync no gradients per step may drift apart)"})
    head_rate: float = field(default=2.0, metadata={
        "help": "hybrid: ids seen at least this often per batch are head ids, bound by "
                "hot_staleness (the compute thread reads and updates them where the shards "
                "are in this process; 0: none)"})
    head_replica: bool = field(default=True, metadata={
        "help": "hybrid, one worker, remote shards, hot_staleness 1: keep the head ids' and hot "
                "tables' rows in a replica on the worker (read and updated there, their "
                "gradients sent on to the PS) instead of a round trip a step; not with a lossy "
                "grads_codec, whose PS copy would drift from the replica"})
    dense_optimizer: str = field(default="adam", metadata={
        "help": "adam, adagrad, sgd, lamb, onebit_adam or onebit_lamb (these two all-reduce "
                "themselves)"})
    lamb_warmup_steps: int = field(default=0, metadata={
        "help": "lamb: steps of linear lr warm-up from 0"})
    lamb_decay_steps: int = field(default=0, metadata={
        "help": "lamb: the step where the lr, decaying linearly after the warm-up, reaches 0 "
                "(0: no decay)"})
    lamb_base_batch: int = field(default=0, metadata={
        "help": "lamb: the batch (rows per step, all ranks) lr was tuned for; the lr used is "
                "lr·sqrt(batch / lamb_base_batch) (0: lr as given)"})
    onebit_freeze_step: int = field(default=100, metadata={
        "help": "onebit_adam/onebit_lamb: fp32 warm-up steps before 1-bit compression"})
    dense_codec: str = field(default="none", metadata={
        "help": "dense all-reduce hook: none, fp16, dct, topk, qsgd, adaquant, onebit, powersgd"})
    activation_keep: float = field(default=1.0, metadata={
        "help": "DCT-MP: fraction of the pooled activations kept in training, above a "
                "threshold reused for 32 steps (1: all; evaluation keeps all); with "
                "embedding_path des, the shards threshold what they send and the gradients "
                "go back at the same positions"})
    lr: float = field(default=1e-3, metadata={"help": "dense learning rate"})
    momentum: float = field(default=0.0, metadata={
        "help": "sgd: momentum (with --sync gossip: decentralised momentum SGD, DmSGD)"})
    rows_codec: str = field(default="none", metadata={"help": "codec of rows PS -> worker"})
    grads_codec: str = field(default="none", metadata={"help": "codec of grads worker -> PS"})
    pooling: str = field(default="sum", metadata={"help": "pooling per sample: sum or mean"})
    embedding_path: str = field(default="rows", metadata={
        "help": "rows (unique rows down, row gradients up) or des (each shard pools its rows "
                "per sample; pooled gradients up: needs gRPC shards)"})
    eval_every: int = field(default=0, metadata={"help": "evaluate every N steps (0: at end)"})
    keep_best: bool | None = field(default=None, metadata={
        "help": "with validation data: end with the state (dense model and PS rows, with "
                "their optimizer state) of the best validation AUC (unset: on when validation "
                "data is given)"})
    seed: int = field(default=0, metadata={"help": "seed of the dense model's init"})
    device: str | None = field(default=None, metadata={"help": "cpu, cuda (default: auto)"})
    timeout_s: float = field(default=30.0, metadata={"help": "PS request timeout"})
    admin_port: int | None = field(default=None, metadata={
        "help": "worker admin REST port; rank r serves port + r (0: any free; unset: off)"})
    admin_host: str = field(default="127.0.0.1", metadata={"help": "admin REST bind address"})
    ps_retry_s: float = field(default=0.0, metadata={
        "help": "seconds a PS request keeps retrying while a shard is down (0: fail at once)"})
    ps_process: bool = field(default=False, metadata={
        "help": "the training steps' PS traffic in a child process (PERSIA's embedding "
                "worker), so that it never holds the GIL the dense compute needs"})
    registry: str | None = field(default=None, metadata={
        "help": "discover the PS shards at this registry (redis://HOST:PORT/DB?job=NAME)"})
    sync: str = field(default="allreduce", metadata={
        "help": f"dense sync strategy: {', '.join(STRATEGIES)}"})
    sync_period: int | None = field(default=None, metadata={
        "help": "sync every H steps (unset: 8 for local_sgd, 1 for the others)"})
    sync_group_size: int = field(default=2, metadata={"help": "ds_sync: ranks per group"})
    sync_schedule: str = field(default="hypercube", metadata={
        "help": "ds_sync: regrouping schedule, hypercube or permutation"})
    sync_elastic_alpha: float | None = field(default=None, metadata={
        "help": "shadow: elastic averaging weight (unset: plain averaging)"})
    gossip_topology: str = field(default="ring", metadata={
        "help": "gossip: ring, exp or onepeer_exp"})
    export_dir: str | None = field(default=None, metadata={
        "help": "write model versions of the running job here, on the export_every_* "
                "cadence (rank 0; persimmon serve --model-dir DIR serves them)"})
    export_every_steps: int = field(default=0, metadata={
        "help": "export a model version every N steps (0: never)"})
    export_every_s: float = field(default=0.0, metadata={
        "help": "export a model version every T seconds (0: never)"})
    export_keep: int = field(default=5, metadata={
        "help": "keep the newest K exported versions and their bases (0: all)"})
    export_full_every: int = field(default=8, metadata={
        "help": "every Nth export is a full version, the others hold only the rows changed "
                "since the previous one (1: all full)"})
    ranks_per_node: int = field(default=2, metadata={
        "help": "hierarchical: ranks per node (consecutive ranks; the first leads)"})
    gadmm_rho: float = field(default=0.1, metadata={"help": "gadmm: the ADMM penalty rho"})

    def __post_init__(self) -> None:
        self._check_cpu()
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {self.mode!r}")
        if isinstance(self.staleness, str) and self.staleness.strip().isdigit():
            self.staleness = int(self.staleness)  # from a flag or the environment
        if self.staleness != "auto" and (isinstance(self.staleness, bool) or not isinstance(
                self.staleness, int) or self.staleness < 0):
            raise ConfigError(f"staleness must be 'auto' or an int >= 0, got "
                              f"{self.staleness!r}")
        if self.prefetch < 1:
            raise ConfigError(f"prefetch must be >= 1, got {self.prefetch}")
        self._check_hot()
        if self.dense_optimizer not in DENSE_OPTIMIZERS:
            raise ConfigError(f"dense_optimizer must be one of {DENSE_OPTIMIZERS}, "
                              f"got {self.dense_optimizer!r}")
        if not self.lr > 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")
        for name in ("rows_codec", "grads_codec"):
            try:
                get_codec(getattr(self, name))
            except PersimmonError as exc:
                raise ConfigError(f"{name}: {exc.message}") from exc
        self._check_compression()
        self._check_embedding()
        if self.eval_every < 0:
            raise ConfigError(f"eval_every must be >= 0, got {self.eval_every}")
        self._check_service()
        if self.ps_retry_s < 0:
            raise ConfigError(f"ps_retry_s must be >= 0, got {self.ps_retry_s}")
        self._check_sync()
        self._check_export()

    def _check_cpu(self) -> None:
        if isinstance(self.gil_switch_ms, bool) or not isinstance(self.gil_switch_ms, int | float) \
                or not 0 <= self.gil_switch_ms <= 1000:
            raise ConfigError(f"gil_switch_ms must be in [0, 1000], got {self.gil_switch_ms!r}")
        if isinstance(self.torch_threads, bool) or not isinstance(self.torch_threads, int) \
                or self.torch_threads < 0:
            raise ConfigError(f"torch_threads must be an int >= 0, got {self.torch_threads!r}")

    def _check_export(self) -> None:
        if self.export_every_steps < 0 or not self.export_every_s >= 0:
            raise ConfigError("export_every_steps and export_every_s must be >= 0")
        if self.export_keep < 0 or self.export_full_every < 1:
            raise ConfigError(f"export_keep must be >= 0 and export_full_every >= 1, got "
                              f"{self.export_keep} and {self.export_full_every}")
        cadence = bool(self.export_every_steps or self.export_every_s)
        if cadence != bool(self.export_dir):
            raise ConfigError("model exports need both export_dir and a cadence "
                              "(export_every_steps or export_every_s)")

    def _check_embedding(self) -> None:
        if self.pooling not in POOLING_MODES:
            raise ConfigError(f"pooling must be one of {POOLING_MODES}, got {self.pooling!r}")
        if self.embedding_path not in EMBEDDING_PATHS:
            raise ConfigError(f"embedding_path must be one of {sorted(EMBEDDING_PATHS)}, "
                              f"got {self.embedding_path!r}")
        if self.embedding_path == "des" and codec_without_feedback(self.rows_codec)[1]:
            raise ConfigError(f"embedding_path 'des': rows_codec {self.rows_codec!r} encodes the "
                              "per-sample partial sums, which never repeat, so its error "
                              "feedback would go to other samples: add error_feedback=false")
        if self.embedding_path == "des" and self.activation_keep < 1 \
                and (self.rows_codec != "none" or self.grads_codec != "none"):
            raise ConfigError(f"embedding_path 'des' with activation_keep "
                              f"{self.activation_keep}: DCT-MP sends the partial sums and their "
                              f"gradients itself (dct_mp, fp16 values), so rows_codec and "
                              f"grads_codec must be 'none', got {self.rows_codec!r} and "
                              f"{self.grads_codec!r}")

    def _check_hot(self) -> None:
        if not 0 <= self.hot_ratio <= 1:
            raise ConfigError(f"hot_ratio must be in [0, 1], got {self.hot_ratio}")
        if not self.head_rate >= 0:
            raise ConfigError(f"head_rate must be >= 0, got {self.head_rate}")
        if isinstance(self.hot_staleness, bool) or not isinstance(self.hot_staleness, int) \
                or self.hot_staleness < 1:
            raise ConfigError(f"hot_staleness must be an int >= 1, got {self.hot_staleness!r}")

    def sync_config(self) -> SyncConfig:
        """The dense sync strategy these settings choose (``SyncConfig.build`` makes it)."""
        return SyncConfig(name=self.sync, every=self.sync_period,
                          group_size=self.sync_group_size, schedule=self.sync_schedule,
                          elastic_alpha=self.sync_elastic_alpha, topology=self.gossip_topology,
                          ranks_per_node=self.ranks_per_node, rho=self.gadmm_rho)

    def _check_sync(self) -> None:
        self.sync_config()
        if self.sync == "allreduce":
            return
        if self.dense_optimizer.startswith("onebit"):
            raise ConfigError(f"{self.dense_optimizer} all-reduces the gradients itself; "
                              f"it needs sync 'allreduce', got {self.sync!r}")
        if self.sync == "gadmm" and self.dense_optimizer != "sgd":
            raise ConfigError("gadmm needs dense_optimizer 'sgd': with Adam's or Adagrad's "
                              "rescaled steps its duals grow without bound (docs/training.md)")
        if self.dense_codec == "none":
            return
        if self.sync in UNCOMPRESSED_SYNCS:
            raise ConfigError(f"{self.sync} sends its payload uncompressed; "
                              f"dense_codec must be 'none', got {self.dense_codec!r}")
        try:   # parameter averaging goes through a codec (CodecAverager), not a DDP hook
            get_codec(self.dense_codec)
        except PersimmonError as exc:
            raise ConfigError(f"sync {self.sync!r} averages parameters through a codec; "
                              f"dense_codec {self.dense_codec!r} is not one: "
                              f"{exc.message}") from exc
        if self.sync == "ds_sync" and lossy_codec(self.dense_codec):
            raise ConfigError(f"sync 'ds_sync' cannot average through the lossy dense_codec "
                              f"{self.dense_codec!r} (its groups share no reference to send "
                              "changes against): use none, fp16 or bf16, or sync local_sgd")

    def _check_service(self) -> None:
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.momentum and self.dense_optimizer != "sgd":
            raise ConfigError(f"momentum is a setting of dense_optimizer 'sgd', not "
                              f"{self.dense_optimizer!r}")
        self._check_lamb()
        if not self.timeout_s > 0:
            raise ConfigError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.admin_port is not None and not 0 <= self.admin_port <= 65535:
            raise ConfigError(f"admin_port must be in [0, 65535], got {self.admin_port}")

    def _check_lamb(self) -> None:
        names = ("lamb_warmup_steps", "lamb_decay_steps", "lamb_base_batch")
        for name in names:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be an int >= 0, got {value!r}")
            if value and self.dense_optimizer != "lamb":
                raise ConfigError(f"{name} is a setting of dense_optimizer 'lamb', not "
                                  f"{self.dense_optimizer!r}")
        if self.lamb_decay_steps and self.lamb_decay_steps <= self.lamb_warmup_steps:
            raise ConfigError(f"lamb_decay_steps must be 0 or more than lamb_warmup_steps, got "
                              f"{self.lamb_decay_steps} <= {self.lamb_warmup_steps}")

    def _check_compression(self) -> None:
        if self.dense_codec not in HOOK_NAMES:
            try:
                get_codec(self.dense_codec)
            except PersimmonError as exc:
                raise ConfigError(f"dense_codec must be one of {HOOK_NAMES} or a codec name: "
                                  f"{exc.message}") from exc
        if self.dense_optimizer.startswith("onebit") and self.dense_codec != "none":
            raise ConfigError(f"{self.dense_optimizer} compresses its own all-reduce; "
                              f"dense_codec must be 'none', got {self.dense_codec!r}")
        if isinstance(self.onebit_freeze_step, bool) \
                or not isinstance(self.onebit_freeze_step, int) or self.onebit_freeze_step < 1:
            raise ConfigError(f"onebit_freeze_step must be an int >= 1, "
                              f"got {self.onebit_freeze_step!r}")
        if not 0 < self.activation_keep <= 1:
            raise ConfigError(f"activation_keep must be in (0, 1], got {self.activation_keep}")

    @property
    def replicates_heads(self) -> bool:
        """Whether a replica may keep the head rows (``head_replica``, hybrid, and a grads
        codec that sends the PS the replica's own updates: a lossy one would let the PS's
        copy, which evaluation and exports read, drift from the rows trained on)."""
        return self.head_replica and self.mode == "hybrid" and not lossy_codec(self.grads_codec)

    @property
    def auto_window(self) -> bool:
        """Whether the window is sized at the job's start (hybrid, staleness ``auto``:
        :mod:`services.worker.embedding.window`)."""
        return self.mode == "hybrid" and self.staleness == "auto"

    @property
    def window(self) -> int | None:
        """Batches allowed in flight (lookup taken, push not acknowledged); None: unbounded.
        With staleness ``auto``, the most the job's start may choose."""
        if self.mode in ("sync", "global_sync"):
            return 1
        if self.mode == "hybrid":
            return MAX_AUTO_WINDOW if self.staleness == "auto" else max(int(self.staleness), 1)
        return None


def ps_table_configs(feature_dims: dict[str, int], *, prefix: str = "", lr: float = 0.05,
                     optimizer: str = "adagrad", seed: int = 0, weight_decay: float = 0.0,
                     initial_accumulator: float = 0.0,
                     table_lr: Mapping[str, float] | None = None) -> list[dict[str, object]]:
    """PS table configs (dicts for ``LocalPS``/YAML), one table ``prefix + feature`` each,
    with the server-side optimizer that trains planted data well (Adagrad, lr 0.05);
    ``table_lr`` sets the lr of some features' tables, ``weight_decay`` every table's L2,
    ``initial_accumulator`` the Adagrads' starting accumulator."""
    if not feature_dims:
        raise ConfigError("feature_dims must name at least one feature")
    table_lr = dict(table_lr or {})
    unknown = sorted(set(table_lr) - set(feature_dims))
    if unknown:
        raise ConfigError(f"table_lr names features {unknown} that are not among "
                          f"{sorted(feature_dims)}")
    return [{"name": f"{prefix}{name}", "dim": int(dim), "seed": seed,
             "optimizer": {"kind": optimizer, "lr": table_lr.get(name, lr),
                           "weight_decay": weight_decay,
                           "initial_accumulator": initial_accumulator}}
            for name, dim in feature_dims.items()]
