"""``persimmon train``: a local cluster on this machine, trained end to end.

:func:`train_on_local_cluster` starts a loader process for the training data and one for the
held-out data (loader specs such as ``criteo:day_*.gz`` or ``synthetic:ROWS``), the PS shards
with one table per sparse feature the loader reports, and N gloo workers; the demo calls it
too. Where the shards run is :data:`PS_PLACEMENTS`: with one worker they are embedded in the
worker's process by default (the PS's own shards, reached without sockets or serialization:
the fastest path on one machine); with more workers, or codecs on the PS wire, they are
gRPC shard processes. With validation data the best state is kept (``keep_best``,
:mod:`services.worker.best`): embedded shards only, whose snapshots are checkpoints into a
temporary directory. :class:`PlantedData` is what ``persimmon worker`` trains on without ``--loader``:
planted data generated in the worker's process.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import urllib.request
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode

from services.common.commands import float_at_least, int_at_least
from services.common.config import print_config
from services.common.errors import ConfigError
from services.loader.prepare import cacheable, prepare_sources
from services.local.ps_reads import ps_initial_rows, ps_read_shards
from services.worker.best import keeps_best
from services.worker.config import TrainerConfig, ps_table_configs
from services.worker.flags import add_training_flags, load_trainer_config
from services.worker.models import ModelConfig
from services.worker.service import (
    InProcessData,
    failure_summary,
    report_summary,
    summary_dict,
)

__all__ = ["PS_PLACEMENTS", "PlantedData", "data_specs", "ps_initial_rows", "ps_placement",
           "ps_read_shards", "register_cli", "train_on_local_cluster"]

PS_PLACEMENTS = {
    "auto": "embedded for one worker without PS-wire codecs, else processes",
    "embedded": "the shards in the worker's process: no sockets, no serialization (1 worker)",
    "processes": "one gRPC shard process per shard, on loopback ports",
}


def ps_placement(ps: str, workers: int, config: TrainerConfig, *, keep_best: bool = False
                 ) -> str:
    """Where the shards run (``embedded`` or ``processes``) for ``--ps`` = ``ps``; a
    ConfigError for an embedded PS that cannot serve these settings, and for ``keep_best``
    anywhere else (its snapshots of the rows are the embedded shards')."""
    if ps not in PS_PLACEMENTS:
        raise ConfigError(f"--ps must be one of {sorted(PS_PLACEMENTS)}, got {ps!r}")
    wire = [name for name in ("rows_codec", "grads_codec")
            if getattr(config, name) != "none"]
    blockers = ([f"{workers} workers (embedded shards serve one)"] if workers != 1 else []) \
        + [f"{name}={getattr(config, name)} (nothing crosses a wire)" for name in wire] \
        + (["ps_process"] if config.ps_process else []) \
        + (["embedding_path=des (the shards pool over gRPC)"]
           if config.embedding_path == "des" else []) \
        + (["a registry"] if config.registry else []) \
        + (["export_dir (exports are made from PS shard checkpoints)"]
           if config.export_dir else [])
    if keep_best and (blockers or ps == "processes"):
        raise ConfigError("--keep-best (on by default with --validation-data) needs the "
                          "embedded PS (--ps embedded: one worker, no PS-wire codecs, "
                          f"no exports), got --ps {ps}"
                          + "".join(f", {b}" for b in blockers)
                          + ": use --keep-best false to only evaluate the validation data")
    if ps == "auto":
        return "processes" if blockers else "embedded"
    if ps == "embedded" and blockers:
        raise ConfigError(f"--ps embedded cannot serve {', '.join(blockers)}: use --ps "
                          "processes")
    return ps

# persimmon train shuffles its training rows: a file in some order (sorted by user, by date)
# otherwise trains on batches of one user or one day (docs/benchmarks.md#quality)
SHUFFLE_BUFFER = 131_072


def _synthetic_rows(spec: str) -> int | None:
    """The row count of a ``synthetic:ROWS`` spec; None for any other source."""
    kind, _, rest = spec.partition(":")
    if kind != "synthetic":
        return None
    rows = rest.partition("?")[0]
    try:
        return int(rows) if rows else 65536
    except ValueError as exc:
        raise ConfigError(f"--train-data: bad row count {rows!r}") from exc


def data_specs(args: argparse.Namespace) -> tuple[str, str | None]:
    """(train spec, eval spec): ``synthetic`` alone means 65,536 rows, and synthetic training
    data is evaluated on the test split unless ``--eval-data`` says otherwise. Both, and
    ``--validation-data``, are checked (spec, files, schema): a ConfigError naming the flag."""
    from services.loader.sources import check_source

    train = str(args.train_data)
    rows = _synthetic_rows(train)
    profile = ""  # the planted data set's parameters (profile, max_vocab, zipf), split apart
    if rows is not None:
        query = parse_qsl(train.partition("?")[2], keep_blank_values=True)
        profile = urlencode([(k, v) for k, v in query if k != "split"])
        train = f"synthetic:{rows}" + (f"?{profile}" if profile else "")
    evaluation = args.eval_data
    if evaluation is None and rows is not None:
        evaluation = f"synthetic:{args.eval_rows}?" + "&".join(filter(None, [profile,
                                                                           "split=test"]))
    for flag, spec in (("--train-data", train), ("--eval-data", evaluation),
                       ("--validation-data", getattr(args, "validation_data", None))):
        if spec is not None:  # a clear ConfigError before any process starts
            try:
                check_source(spec)
            except ConfigError as exc:
                raise ConfigError(f"{flag}: {exc.message}") from exc
    return train, evaluation


def _oracle(train_spec: str, eval_spec: str | None, seed: int) -> dict[str, float] | None:
    """The planted data's oracle on the eval split, when both are the synthetic generator's."""
    if _synthetic_rows(train_spec) is None or eval_spec is None \
            or not eval_spec.startswith("synthetic:") or "split=test" not in eval_spec:
        return None
    from services.loader.config import SourceSpec
    from services.loader.planted import SyntheticDataset
    from services.loader.sources.synthetic import synthetic_config_of

    rows = int(eval_spec.split(":", 1)[1].partition("?")[0])
    return SyntheticDataset(synthetic_config_of(SourceSpec.parse(train_spec), seed)).oracle(rows)


def _sparse_features(admin_url: str) -> list[str]:
    """The sparse feature names a running loader reports (``GET /v1/sources``)."""
    with urllib.request.urlopen(admin_url + "/v1/sources", timeout=10) as response:
        sources = json.load(response)
    return list(sources[0]["sparse_features"])


@dataclass(frozen=True, slots=True)
class _Data:
    """Where the workers' data comes from: ``sources`` are run_local_training's arguments
    (loader addresses, or cached data each rank reads), ``cache`` what the summary says of
    the column cache (None without it), ``admin_url`` the training loader's (exports)."""

    features: list[str]
    sources: dict[str, Any]
    cache: dict[str, Any] | None = None
    admin_url: str = ""


def _cached_data(specs: tuple[str, str | None, str | None], cache_dir: str | None, *,
                 batch_size: int, epochs: int, seed: int | None,
                 validation_fraction: float | None = None) -> _Data:
    """The (train, eval, validation) file sources parsed once into the column cache, each
    rank reading its share there: no loader process, no stream, no parse after the first.
    ``validation_fraction``: the validation rows are the last fraction of the training
    files' rows (in file order), and training reads the rows before them."""
    names = ("train", "eval", "validation")
    given = [(name, spec) for name, spec in zip(names, specs, strict=True) if spec is not None]
    cached = dict(zip([name for name, _ in given], prepare_sources(
        [spec for _, spec in given], cache_dir=cache_dir, show=sys.stderr.isatty()),
        strict=True))
    if validation_fraction is not None:
        cached["train"], cached["validation"] = cached["train"].split_last(validation_fraction)
    train = cached["train"]
    sources: dict[str, Any] = {"train_batches": train.share(batch_size, epochs=epochs,
                                                            seed=seed)}
    if "eval" in cached:
        sources["eval_batches"] = cached["eval"].share(4096, seed=None)
    if "validation" in cached:
        sources["validation_loader"] = cached["validation"].share(4096, seed=None)
    return _Data(features=train.features, sources=sources,
                 cache={name: data.describe() for name, data in cached.items()})


def _loaders(stack: ExitStack, specs: tuple[str, str | None, str | None], *, batch_size: int,
             workers: int, epochs: int, seed: int, shuffle_buffer: int) -> _Data:
    """Loader processes for the (train, eval, validation) specs, on loopback ports."""
    from services.local.processes import LocalLoader

    train, evaluation, validation = specs
    loader = stack.enter_context(LocalLoader(train, batch_size=batch_size, world_size=workers,
                                             seed=seed, epochs=epochs,
                                             shuffle_buffer=shuffle_buffer))
    held_out = {name: stack.enter_context(LocalLoader(spec, batch_size=4096,
                                                      world_size=workers, seed=seed)).address
                for name, spec in (("eval_loader", evaluation),
                                   ("validation_loader", validation)) if spec}
    return _Data(features=_sparse_features(loader.admin_url),
                 sources={"loader": loader.address, **held_out}, admin_url=loader.admin_url)


def check_validation_fraction(fraction: float | None, *, validation_data: str | None,
                              cached: bool) -> None:
    """A ConfigError for a ``--validation-fraction`` that cannot be honoured: not in (0, 1),
    given with ``--validation-data``, or for training data not read through the column
    cache (the rows are cut there)."""
    if fraction is None:
        return
    if not 0 < fraction < 1:
        raise ConfigError(f"--validation-fraction must be in (0, 1), got {fraction}")
    if validation_data is not None:
        raise ConfigError("give --validation-data or --validation-fraction, not both")
    if not cached:
        raise ConfigError("--validation-fraction cuts the validation rows from training "
                          "files read through the column cache: it needs file sources, "
                          "--cache and no --export-dir (else give --validation-data)")


def train_on_local_cluster(*, train_data: str, eval_data: str | None, config: TrainerConfig,
                           validation_data: str | None = None,
                           validation_fraction: float | None = None,
                           model: ModelConfig, workers: int = 1, shards: int | None = None,
                           dim: int = 16, ps_lr: float | None = None,
                           ps_optimizer: str = "adagrad", ps_weight_decay: float = 0.0,
                           ps_initial_accumulator: float | None = None,
                           ps_table_lr: dict[str, float] | None = None,
                           batch_size: int = 512, shuffle_buffer: int = 0,
                           epochs: int = 1, data_seed: int = 0, ps: str = "auto",
                           cache: bool = True, cache_dir: str | None = None
                           ) -> dict[str, Any]:
    """Start loaders on loopback ports and the PS shards where ``ps`` places them
    (:func:`ps_placement`), train ``workers`` gloo ranks, stop everything; return the
    summary (with ``oracle_auc`` for planted data and ``ps`` = where the shards ran).
    ``shards``: default one embedded shard (holding every table: no per-shard calls to pay
    for in one process), two shard processes.
    ``validation_data``: the loader spec the best state is selected on;
    ``validation_fraction``, instead: the last fraction of the training files' rows (in
    file order: the latest, for time-ordered files) are held out and validated on. ``ps_lr`` and
    ``ps_initial_accumulator`` default to the model's
    (:meth:`ModelConfig.ps_optimizer_defaults`). With ``cache`` and file sources only, the
    data is parsed once into the column cache (``cache_dir``) and every worker reads it
    there (:func:`_cached_data`); else loader processes stream it."""
    from services.local.processes import LocalPS
    from services.ps.inprocess import InProcessShards
    from services.worker.local_ranks import run_local_training

    specs = (train_data, eval_data, validation_data)
    cached = cache and not config.export_dir and all(
        cacheable(s) for s in specs if s is not None)
    check_validation_fraction(validation_fraction, validation_data=validation_data,
                              cached=cached)
    keep_best = keeps_best(config, validation=validation_data is not None
                           or validation_fraction is not None)
    placement = ps_placement(ps, workers, config, keep_best=keep_best)

    with ExitStack() as stack:
        if cached:
            data = _cached_data(specs, cache_dir, batch_size=batch_size, epochs=epochs,
                                seed=data_seed if shuffle_buffer else None,
                                validation_fraction=validation_fraction)
        else:
            data = _loaders(stack, specs, batch_size=batch_size, workers=workers,
                            epochs=epochs, seed=data_seed, shuffle_buffer=shuffle_buffer)
        features = data.features
        lr, accumulator = model.ps_optimizer_defaults(ps_optimizer)
        tables = ps_table_configs({f: model.table_dim(dim) for f in features},
                                  lr=lr if ps_lr is None else ps_lr,
                                  optimizer=ps_optimizer, weight_decay=ps_weight_decay,
                                  initial_accumulator=(accumulator if ps_initial_accumulator
                                                       is None else ps_initial_accumulator),
                                  table_lr=ps_table_lr)
        exports = stack.enter_context(tempfile.TemporaryDirectory(prefix="persimmon-export-")) \
            if config.export_dir else None  # the PS checkpoints each export is made from
        attach = None
        if placement == "embedded":
            snapshots = ({"checkpoint_dir": stack.enter_context(tempfile.TemporaryDirectory(
                prefix="persimmon-best-"))} if keep_best else None)  # the best state's rows
            embedded = InProcessShards(tables, num_shards=shards or 1,
                                       shard_config=snapshots).warm_up()
            where: dict[str, Any] = {"rows_client": embedded}
        else:
            cluster = stack.enter_context(LocalPS(shards or 2, tables, exports,
                                                  registry=config.registry))
            where = {"ps_addresses": cluster.addresses}
            attach = _online_export(config, model, exports, cluster.admin_urls,
                                    data.admin_url)
            if workers == 1 and config.replicates_heads:
                from services.ps.replica import HeadReplica

                where["head_replica"] = HeadReplica()
        summary = summary_dict(run_local_training(
            **where, **data.sources, model=model, config=config, num_workers=workers,
            attach=attach))
    summary["ps"] = placement
    summary["cache"] = data.cache
    summary["ps_optimizer"] = tables[0]["optimizer"]  # every table's, but --ps-table-lr's lr
    oracle = _oracle(train_data, eval_data, data_seed)
    if oracle is not None:
        summary.update(oracle_auc=oracle["auc"], oracle_logloss=oracle["logloss"])
    return summary


def _online_export(config: TrainerConfig, model: ModelConfig, checkpoint_dir: str | None,
                   ps_admin_urls: list[str], loader_admin_url: str
                   ) -> Callable[[Any], object] | None:
    """Rank 0's model exports on ``config``'s cadence (``attach``), or None without
    ``export_dir``."""
    if checkpoint_dir is None:
        return None
    from services.serve.online import OnlineExport, loader_feature_spec

    return OnlineExport.from_config(
        config, checkpoint_dir=checkpoint_dir, ps_admin_urls=ps_admin_urls, model=model,
        spec=loader_feature_spec(loader_admin_url), read_shards=ps_read_shards).attach


class PlantedData:
    """The :class:`~services.worker.service.InProcessSource` of ``persimmon worker`` without
    ``--loader``: the loader's planted data generated in the worker's process (``--train-data
    synthetic[:ROWS]``), with the oracle metrics of its test split."""

    def check(self, args: argparse.Namespace) -> None:
        data_specs(args)
        if not args.loader and _synthetic_rows(str(args.train_data)) is None:
            raise ConfigError("without --loader, --train-data must be synthetic[:ROWS]")

    def data(self, args: argparse.Namespace, rank: int, world: int) -> InProcessData:
        from services.loader.config import SourceSpec
        from services.loader.planted import SyntheticDataset
        from services.loader.sources.synthetic import synthetic_config_of

        train_spec, eval_spec = data_specs(args)
        rows = _synthetic_rows(train_spec)
        if rows is None:
            raise ConfigError("without --loader, --train-data must be synthetic[:ROWS]")
        dataset = SyntheticDataset(synthetic_config_of(SourceSpec.parse(train_spec),
                                                       args.data_seed))
        train = [b for _ in range(args.epochs) for b in dataset.batches(args.batch_size, rows)]
        test = list(dataset.batches(4096, args.eval_rows, "test"))
        return InProcessData(features=dataset.config.sparse_names, train=train[rank::world],
                             test=test[rank::world],
                             oracle=_oracle(train_spec, eval_spec, args.data_seed))


def _run_train(args: argparse.Namespace) -> int:
    from services.local.processes import stopping_children_on_sigterm

    config = load_trainer_config(args)
    print_config("train", config)
    train_spec, eval_spec = data_specs(args)
    specs = (train_spec, eval_spec, args.validation_data)
    check_validation_fraction(  # before anything starts, as the placement below
        args.validation_fraction, validation_data=args.validation_data,
        cached=args.cache and not config.export_dir and all(
            cacheable(s) for s in specs if s is not None))
    if args.id_weights and args.model not in ("deepfm", "wide_deep"):
        raise ConfigError(f"--id-weights is a first-order part of deepfm and wide_deep, not "
                          f"of {args.model}")
    keep = keeps_best(config, validation=args.validation_data is not None
                      or args.validation_fraction is not None)
    ps_placement(args.ps, args.workers, config, keep_best=keep)
    if args.check_config:
        return 0
    with stopping_children_on_sigterm(), failure_summary(args.summary_json):
        summary = train_on_local_cluster(
            train_data=train_spec, eval_data=eval_spec, config=config,
            validation_data=args.validation_data,
            validation_fraction=args.validation_fraction,
            model=ModelConfig(name=args.model, dense_norm=args.dense_norm,
                              id_weights=args.id_weights),
            workers=args.workers, shards=args.shards,
            dim=args.dim, ps_lr=args.ps_lr, ps_optimizer=args.ps_optimizer,
            ps_weight_decay=args.ps_weight_decay, ps_table_lr=args.ps_table_lr,
            ps_initial_accumulator=args.ps_initial_accumulator,
            batch_size=args.batch_size, shuffle_buffer=args.shuffle_buffer,
            epochs=args.epochs, data_seed=args.data_seed, ps=args.ps, cache=args.cache,
            cache_dir=args.cache_dir)
    return report_summary(summary, args.summary_json)


def _table_lrs(text: str) -> dict[str, float]:
    """``FEATURE=LR[,FEATURE=LR...]`` as a dict."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep or not name.strip():
            raise argparse.ArgumentTypeError(f"bad table lr {part!r}: FEATURE=LR")
    return out


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    train = subparsers.add_parser("train", help="train on a local cluster (loaders, PS, workers)")
    add_training_flags(train)
    train.add_argument("--validation-data", help="loader spec of the validation data: "
                       "evaluated every --eval-every steps and at the end; the state of the "
                       "best validation AUC is kept (--keep-best, default with it)")
    train.add_argument("--validation-fraction", type=float, default=None,
                       help="without --validation-data: hold out the LAST fraction F of the "
                            "training files' rows (in file order: the latest rows of "
                            "time-ordered data) as the validation data, train on the rest")
    train.add_argument("--shards", type=int_at_least(1), default=None,
                       help="PS shards (default: 1 in the worker's process, 2 processes)")
    train.add_argument("--ps", default="auto", choices=list(PS_PLACEMENTS),
                       help="where the PS shards run: " + "; ".join(
                           f"{k}: {v}" for k, v in PS_PLACEMENTS.items()))
    train.add_argument("--workers", type=int_at_least(1), default=1, help="worker processes (gloo)")
    train.add_argument("--dim", type=int_at_least(1), default=16, help="embedding dimension")
    (fm_lr, fm_acc), (lr, acc) = (ModelConfig(name=m).ps_optimizer_defaults("adagrad")
                                  for m in ("deepfm", "dlrm"))  # the help states them
    train.add_argument("--ps-lr", type=float_at_least(0, inclusive=False), default=None,
                       help=f"PS learning rate (default: {fm_lr} for deepfm's Adagrad, else "
                            f"{lr})")
    train.add_argument("--ps-optimizer", default="adagrad",
                       choices=["sgd", "adagrad", "rowwise_adagrad", "adam", "ftrl"],
                       help="the PS tables' optimizer")
    train.add_argument("--shuffle-buffer", type=int_at_least(0), default=SHUFFLE_BUFFER,
                       help="training rows shuffled together by the loader (0: file order)")
    train.add_argument("--ps-weight-decay", type=float_at_least(0), default=0.0,
                       help="L2 of every PS table's rows (added to their gradients)")
    train.add_argument("--ps-initial-accumulator", type=float_at_least(0), default=None,
                       help="the PS Adagrads' starting accumulator (0: the first step of "
                            f"every element is +-lr; default: {fm_acc:g} for deepfm, else "
                            f"{acc:g})")
    train.add_argument("--ps-table-lr", type=_table_lrs, default=None,
                       help="PS lr of some features' tables: FEATURE=LR[,FEATURE=LR...]")
    train.add_argument("--cache", action=argparse.BooleanOptionalAction, default=True,
                       help="file sources: parse them once into the column cache and read "
                            "it in every later epoch and run (docs/loader.md#the-column-cache);"
                            " --no-cache streams them from loader processes")
    train.add_argument("--cache-dir", default=None,
                       help="the column cache's directory (default: $PERSIMMON_CACHE_DIR, "
                            "else ~/.cache/persimmon/columns)")
    train.add_argument("--dense-norm", action=argparse.BooleanOptionalAction, default=True,
                       help="standardise the dense features with statistics of the first "
                            "training samples, kept in the model (models.DenseNorm)")
    train.add_argument("--id-weights", action=argparse.BooleanOptionalAction, default=False,
                       help="deepfm, wide_deep: the first-order part is a per-id weight (an "
                            "extra column in every table), as in logistic regression")
    train.set_defaults(func=_run_train)
