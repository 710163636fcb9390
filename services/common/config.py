"""Configuration: keyword-only dataclasses filled from YAML, ``PERSIMMON_*`` env and flags.

Precedence: defaults < YAML file < environment < command-line flags. Unknown keys in any
source are a :class:`ConfigError`; each dataclass validates itself in ``__post_init__``.
Flags are generated from the dataclass fields (``--grpc-port`` for ``grpc_port``), so
a field is declared once.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import types
import typing
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

from services.common.errors import ConfigError

__all__ = ["add_flags", "config_to_dict", "flag_values", "from_dict", "load_config", "print_config"]

T = TypeVar("T")
_SCALARS = (int, float, str, bool)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _coerce_dataclass(value: Any, tp: Any, where: str) -> Any:
    if isinstance(value, tp):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {value!r}")
    return from_dict(tp, value, where=where)


def _coerce_sequence(value: Any, tp: Any, where: str) -> Any:
    (item_tp, *_) = typing.get_args(tp) or (Any,)
    if isinstance(value, str):
        value = [v for v in value.split(",") if v]
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{where}: expected a list, got {value!r}")
    items = [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    return items if typing.get_origin(tp) is list else tuple(items)


def _coerce_bool(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("1", "true", "yes", "on"):
        return True
    if str(value).lower() in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{where}: expected a boolean, got {value!r}")


def _coerce_scalar(value: Any, tp: Any, where: str) -> Any:
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}")
    try:
        return tp(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}") from exc


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Convert ``value`` to the field type ``tp`` (strings from env/flags included)."""
    tp, optional = _unwrap_optional(tp)
    if value is None or (optional and value in ("", "none", "null")):
        if optional:
            return None
        raise ConfigError(f"{where}: a value is required")
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _coerce_dataclass(value, tp, where)
    if origin in (list, tuple):
        return _coerce_sequence(value, tp, where)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        return _coerce_bool(value, where)
    if tp in _SCALARS:
        return _coerce_scalar(value, tp, where)
    if isinstance(tp, type) and issubclass(tp, str):  # str-valued enums
        try:
            return tp(value)
        except ValueError as exc:
            choices = [m.value for m in typing.cast("type[enum.Enum]", tp)]
            raise ConfigError(f"{where}: {value!r} is not one of {choices}") from exc
    return value


def from_dict(cls: type[T], data: Mapping[str, Any], *, where: str = "config") -> T:
    """Build ``cls`` from a mapping; unknown keys and bad values are ConfigError."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(typing.cast(Any, cls)) if f.init}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown}; known: {sorted(names)}")
    kwargs = {k: _coerce(v, hints[k], f"{where}.{k}") for k, v in data.items()}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def _env_values(cls: type, prefix: str, environ: Mapping[str, str]) -> dict[str, str]:
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    out: dict[str, str] = {}
    for key, value in environ.items():
        if not key.startswith(prefix):
            continue
        name = key[len(prefix):].lower()
        if name not in names:
            raise ConfigError(f"environment variable {key} is not a setting; known: "
                              f"{[prefix + n.upper() for n in sorted(names)]}")
        out[name] = value
    return out


def add_flags(parser: argparse.ArgumentParser, cls: type, *,
              only: Collection[str] | None = None) -> None:
    """Add one ``--flag`` per scalar or list field of ``cls`` (default None: not given);
    ``only`` limits them to those fields."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if only is not None and f.name not in only:
            continue
        tp, _ = _unwrap_optional(hints[f.name])
        if dataclasses.is_dataclass(tp) or (
            typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0])
        ):
            continue  # nested structures come from YAML
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=None,
                            help=f.metadata.get("help", ""))


def flag_values(cls: type, args: Any) -> dict[str, Any]:
    """The flags of an argparse namespace that belong to ``cls`` and were given."""
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


def load_config(cls: type[T], *, yaml_path: str | Path | None = None,
                env_prefix: str | None = None, environ: Mapping[str, str] | None = None,
                flags: Mapping[str, Any] | None = None) -> T:
    """Merge YAML, env (keys ``env_prefix + FIELD``) and flags over the defaults of ``cls``."""
    merged: dict[str, Any] = {}
    if yaml_path:
        try:
            loaded = yaml.safe_load(Path(yaml_path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read config file {yaml_path}: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {yaml_path} must hold a mapping")
        merged.update(loaded)
    if env_prefix:
        merged.update(_env_values(cls, env_prefix, os.environ if environ is None else environ))
    merged.update({k: v for k, v in (flags or {}).items() if v is not None})
    return from_dict(cls, merged)


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """A JSON-ready dict of a config dataclass (enums as values, paths as strings)."""
    def clean(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [clean(x) for x in v]
        if isinstance(v, Path):
            return str(v)
        if isinstance(v, enum.Enum) and isinstance(v, str):  # str-valued enums
            return v.value
        return v
    return clean(dataclasses.asdict(cfg))


def print_config(name: str, cfg: Any) -> None:
    """Print the effective config at start, as YAML."""
    print(f"# effective {name} config\n" + yaml.safe_dump(config_to_dict(cfg), sort_keys=True),
          flush=True)
