"""``persimmon token``: make the shared bearer token a deployment needs.

``persimmon token`` prints a fresh token (32 random bytes, URL-safe base64: 43 characters);
``persimmon token --env-file .env`` writes it as ``PERSIMMON_TOKEN=...`` into that file (mode
0600), keeping a token the file already has unless ``--rotate``. ``docker compose`` reads
``.env`` next to compose.yaml; Kubernetes takes it as a Secret
(``kubectl create secret generic persimmon-token --from-literal=token=$(persimmon token)``).
"""

from __future__ import annotations

import argparse
import os
import secrets
from pathlib import Path

from services.common.auth import TOKEN_ENV, load_token

__all__ = ["new_token", "register_cli", "write_env_token"]


def new_token() -> str:
    """A fresh random token, valid for :func:`services.common.auth.load_token`."""
    return load_token(secrets.token_urlsafe(32)) or ""


def write_env_token(path: Path | str, *, rotate: bool = False) -> bool:
    """Put ``PERSIMMON_TOKEN=<token>`` in the env file ``path`` (made 0600); an existing
    token line is kept unless ``rotate``. True when a token was written."""
    path = Path(path)
    lines = path.read_text().splitlines() if path.exists() else []
    prefix = f"{TOKEN_ENV}="
    present = [i for i, line in enumerate(lines) if line.startswith(prefix)]
    if present and not rotate:
        return False
    lines = [line for line in lines if not line.startswith(prefix)] + [prefix + new_token()]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    os.chmod(path, 0o600)
    return True


def _run(args: argparse.Namespace) -> int:
    if args.env_file is None:
        print(new_token())
        return 0
    written = write_env_token(args.env_file, rotate=args.rotate)
    print(f"{TOKEN_ENV} {'written to' if written else 'already set in'} {args.env_file}")
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "token", help="make a bearer token for a deployment (print it, or write an env file)",
        description="Print a fresh random bearer token, or write it as PERSIMMON_TOKEN=... "
                    "into an env file (docker compose reads .env).")
    parser.add_argument("--env-file", help="write PERSIMMON_TOKEN into this file (mode 0600) "
                        "instead of printing it")
    parser.add_argument("--rotate", action="store_true",
                        help="replace a token the env file already has")
    parser.set_defaults(func=_run)
