"""Bearer-token authentication and the security settings of servers and clients.

A deployment turns authentication on by giving every process the same token, either in
``PERSIMMON_TOKEN`` or in a file named by ``PERSIMMON_TOKEN_FILE``. Servers then require
``authorization: Bearer <token>`` on every gRPC call and on every admin route but
``/healthz``, ``/readyz`` and ``/metrics`` (``PERSIMMON_ADMIN_OPEN_READS=1`` opens the admin
GETs too); clients send it. Tokens are compared in constant time. TLS settings come from
:mod:`services.common.tls`.

    missing or not a bearer token  →  Unauthenticated   (gRPC UNAUTHENTICATED, HTTP 401)
    a token that does not match    →  PermissionDenied  (gRPC PERMISSION_DENIED, HTTP 403)
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from services.common.errors import ConfigError, PermissionDenied, Unauthenticated
from services.common.tls import ClientTLS, ServerTLS

__all__ = [
    "OPEN_READS_ENV",
    "TOKEN_ENV",
    "TOKEN_FILE_ENV",
    "ClientSecurity",
    "ServerSecurity",
    "check_authorization",
    "is_loopback",
    "load_token",
]

TOKEN_ENV = "PERSIMMON_TOKEN"
TOKEN_FILE_ENV = "PERSIMMON_TOKEN_FILE"
OPEN_READS_ENV = "PERSIMMON_ADMIN_OPEN_READS"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def _valid(token: str, where: str) -> str:
    token = token.strip()
    if not token:
        raise ConfigError(f"{where}: the token is empty")
    if not all(0x21 <= ord(c) <= 0x7E for c in token):
        raise ConfigError(f"{where}: a token must be printable ASCII without spaces")
    return token


def load_token(token: str | None = None, *, token_file: str | Path | None = None,
               environ: Mapping[str, str] | None = None) -> str | None:
    """The token to use: ``token``, else ``token_file``, else ``PERSIMMON_TOKEN``, else the
    file in ``PERSIMMON_TOKEN_FILE``; None when none is configured (authentication off)."""
    env = os.environ if environ is None else environ
    if token is not None:
        return _valid(token, "token")
    if token_file is None:
        if env.get(TOKEN_ENV):
            return _valid(env[TOKEN_ENV], TOKEN_ENV)
        token_file = env.get(TOKEN_FILE_ENV) or None
    if token_file is None:
        return None
    try:
        return _valid(Path(token_file).read_text(), f"token file {token_file}")
    except OSError as exc:
        raise ConfigError(f"cannot read token file {token_file}: {exc}") from exc


def check_authorization(header: str | None, token: str) -> None:
    """Accept ``Bearer <token>`` (scheme case-insensitive); raise Unauthenticated when the
    header is missing or not a bearer token, PermissionDenied when the token is wrong."""
    scheme, _, given = (header or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise Unauthenticated("this server requires a bearer token: send 'authorization: Bearer "
                              "<token>' (clients read PERSIMMON_TOKEN or PERSIMMON_TOKEN_FILE)")
    if not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise PermissionDenied("the bearer token is not valid for this server")


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach (a server there needs no token)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerSecurity:
    """What a server demands: a token (None: no authentication), TLS (None: plaintext), and
    whether its admin GETs stay open with a token set (``admin_open_reads``)."""

    token: str | None = None
    tls: ServerTLS | None = None
    admin_open_reads: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ServerSecurity:
        return cls(token=load_token(environ=environ), tls=ServerTLS.from_env(environ),
                   admin_open_reads=_flag(os.environ if environ is None else environ,
                                          OPEN_READS_ENV))


def _flag(env: Mapping[str, str], name: str) -> bool:
    value = env.get(name, "").strip().lower()
    if value not in _TRUE + _FALSE:
        raise ConfigError(f"{name} must be one of 1/true/yes/on or 0/false/no/off, "
                          f"got {env[name]!r}")
    return value in _TRUE


@dataclass(frozen=True, kw_only=True, slots=True)
class ClientSecurity:
    """What a client presents: a token to send and TLS settings (None: plaintext)."""

    token: str | None = None
    tls: ClientTLS | None = None

    @classmethod
    def resolve(cls, *, token: str | None = None, tls: ClientTLS | None = None,
                environ: Mapping[str, str] | None = None) -> ClientSecurity:
        """Explicit arguments first, then ``PERSIMMON_TOKEN``/``PERSIMMON_TLS_CA``… settings."""
        return cls(token=load_token(token, environ=environ),
                   tls=tls if tls is not None else ClientTLS.from_env(environ))

    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        """gRPC call metadata carrying the token, or None."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else None

    def headers(self) -> dict[str, str]:
        """HTTP headers carrying the token."""
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}
