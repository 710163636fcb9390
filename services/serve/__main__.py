"""``persimmon serve`` (a prediction server) and ``persimmon export`` (a model version from a
job checkpoint).

Both need two things of the PS that serving does not import (docs/design.md, layering): the
initial rows of ids never trained and the PS checkpoint reader. The caller of
:func:`register_cli` injects them (the CLI passes the PS's own functions).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from services.common.checkpoints import latest_complete
from services.common.commands import add_service_command, run_commands
from services.common.config import add_flags, flag_values, from_dict, load_config, print_config
from services.common.errors import ConfigError, NotFound
from services.common.lifecycle import run_service
from services.loader import spec_from_source
from services.serve.config import ExportConfig, ServeConfig
from services.serve.export import list_versions
from services.serve.rows import InitialRows

if TYPE_CHECKING:  # export needs torch (the [train] extra); serve does not
    from services.serve.sources import ReadShards
    from services.worker.models import ModelConfig

__all__ = ["export_from_flags", "load_export_config", "load_serve_config", "main",
           "register_cli"]


def load_serve_config(args: argparse.Namespace) -> ServeConfig:
    return load_config(ServeConfig, yaml_path=args.config, env_prefix="PERSIMMON_SERVE_",
                       flags=flag_values(ServeConfig, args))


def load_export_config(args: argparse.Namespace) -> ExportConfig:
    return load_config(ExportConfig, yaml_path=args.config, env_prefix="PERSIMMON_EXPORT_",
                       flags=flag_values(ExportConfig, args))


def _needs(what: str, value: Any) -> Any:
    if value is None:
        raise ConfigError(f"this command needs the PS's {what}, injected by the program that "
                          "registers it (the persimmon CLI does)")
    return value


def _model_config(cfg: ExportConfig) -> ModelConfig:
    from services.worker.models import ModelConfig

    if cfg.model_config is None:
        return ModelConfig(name=cfg.model)
    try:
        data = yaml.safe_load(Path(cfg.model_config).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read model config {cfg.model_config}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"model config {cfg.model_config} must hold a mapping")
    return from_dict(ModelConfig, data, where=f"model config {cfg.model_config}")


def _torch_installed() -> bool:
    try:
        return importlib.util.find_spec("torch") is not None
    except ImportError:  # an import hook that refuses it
        return False


def export_from_flags(cfg: ExportConfig, read_shards: ReadShards) -> dict[str, Any]:
    """Write one model version from ``cfg``'s job checkpoint; returns a summary."""
    if not _torch_installed():
        raise ConfigError("persimmon export reads the trainer's dense weights with torch: "
                          "install the train extra (pip install 'persimmon[train]')")
    from services.serve.sources import export_job_checkpoint

    model = _model_config(cfg)  # the flags first: nothing is read before they are checked
    spec = spec_from_source(cfg.features, cfg.dense_transform())
    checkpoint_id = cfg.job_checkpoint
    if not Path(cfg.checkpoint_dir).is_dir():
        raise ConfigError(f"--checkpoint-dir {cfg.checkpoint_dir} is not a directory")
    if checkpoint_id == "latest":
        newest = latest_complete(cfg.checkpoint_dir)
        if newest is None:
            raise NotFound(f"no complete job checkpoint in {cfg.checkpoint_dir}")
        checkpoint_id = newest["checkpoint_id"]
    base = cfg.base
    if base == "latest":
        versions = list_versions(cfg.out)
        base = versions[-1]["version_id"] if versions else None
    manifest = export_job_checkpoint(
        cfg.checkpoint_dir, checkpoint_id, cfg.out, read_shards=read_shards,
        model=model, spec=spec,
        table_prefix=cfg.table_prefix, pooling=cfg.pooling, row_dtype=cfg.row_dtype,
        keep=cfg.keep or None, base=base,
        ps_tables=[t for t in cfg.ps_tables.split(",") if t])
    return {"version_id": manifest["version_id"], "step": manifest["step"], "base": base,
            "out": str(Path(cfg.out) / manifest["version_id"]),
            "tables": {n: {"rows": t["rows"], "tombstones": t["tombstones"]}
                       for n, t in manifest["tables"].items()},
            "bytes": sum(f["bytes"] for f in manifest["files"].values())}


def register_cli(subparsers: argparse._SubParsersAction, *,
                 initial_rows: InitialRows | None = None,
                 read_shards: ReadShards | None = None) -> None:
    """Add ``serve`` and ``export``; ``initial_rows`` and ``read_shards`` come from the PS."""

    def run_serve(args: argparse.Namespace) -> int:
        from services.serve.service import ServeService

        cfg = load_serve_config(args)
        print_config("serve", cfg)
        if Path(cfg.model_dir).exists() and not Path(cfg.model_dir).is_dir():
            raise ConfigError(f"--model-dir {cfg.model_dir} is not a directory")
        if args.check_config:
            return 0
        rows = _needs("initial rows", initial_rows)
        asyncio.run(run_service(ServeService(cfg, initial_rows=rows),
                                ready_file=args.ready_file))
        return 0

    def run_export(args: argparse.Namespace) -> int:
        cfg = load_export_config(args)
        summary = export_from_flags(cfg, _needs("checkpoint reader", read_shards))
        print(json.dumps(summary, indent=1, sort_keys=True), flush=True)
        return 0

    add_service_command(
        subparsers, "serve", ServeConfig, run_serve,
        help="serve predictions from the model versions in a directory",
        description="Serve predictions over REST from the newest complete model version in "
                    "--model-dir, hot-swapping to newer ones as they appear.",
        config_help="YAML file with serve settings",
        ready_help="write the bound port here as JSON once serving")

    export = subparsers.add_parser(
        "export", help="write a model version from a job checkpoint",
        description="Write one model version (dense weights, feature spec, every table's rows)"
                    " from a complete job checkpoint into --out.")
    export.add_argument("--config", help="YAML file with export settings")
    add_flags(export, ExportConfig)
    export.set_defaults(func=run_export)


def main(argv: list[str] | None = None) -> int:
    """``python -m services.serve serve|export ...`` without the PS's functions injected:
    use the ``persimmon`` command."""
    return run_commands(register_cli, argv, prog="python -m services.serve",
                        description="Serve or export model versions.")


if __name__ == "__main__":
    raise SystemExit(main())
