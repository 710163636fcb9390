"""TLS settings for gRPC and the admin servers, from explicit paths or ``PERSIMMON_TLS_*``.

Server side (every gRPC and admin server of the process):
    PERSIMMON_TLS_CERT, PERSIMMON_TLS_KEY   PEM certificate chain and private key
    PERSIMMON_TLS_CLIENT_CA                 optional: require client certificates signed by
                                            this CA (mutual TLS)
Client side (PSClient, LoaderClient, AdminClient):
    PERSIMMON_TLS_CA                        PEM roots that sign the servers' certificates;
                                            setting it turns TLS on
    PERSIMMON_TLS_CLIENT_CERT, PERSIMMON_TLS_CLIENT_KEY   optional client identity (mTLS)
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from services.common.errors import ConfigError

__all__ = ["ClientTLS", "ServerTLS"]


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the TLS {what} {path}: {exc}") from exc


def _pair(cert: str | None, key: str | None, names: str) -> None:
    if (cert is None) != (key is None):
        raise ConfigError(f"{names}: give both the certificate and its key, or neither")


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerTLS:
    """A server certificate and key; ``client_ca`` set means clients must present a
    certificate signed by it."""

    cert: str
    key: str
    client_ca: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ServerTLS | None:
        env = os.environ if environ is None else environ
        cert, key = env.get("PERSIMMON_TLS_CERT") or None, env.get("PERSIMMON_TLS_KEY") or None
        _pair(cert, key, "PERSIMMON_TLS_CERT/PERSIMMON_TLS_KEY")
        client_ca = env.get("PERSIMMON_TLS_CLIENT_CA") or None
        if cert is None or key is None:
            if client_ca:
                raise ConfigError("PERSIMMON_TLS_CLIENT_CA needs PERSIMMON_TLS_CERT and _KEY")
            return None
        return cls(cert=cert, key=key, client_ca=client_ca)

    def grpc_credentials(self) -> grpc.ServerCredentials:
        ca = _read(self.client_ca, "client CA") if self.client_ca else None
        return grpc.ssl_server_credentials(
            [(_read(self.key, "key"), _read(self.cert, "certificate"))],
            root_certificates=ca, require_client_auth=ca is not None)

    def uvicorn_options(self) -> dict[str, Any]:
        """Keyword arguments of ``uvicorn.Config`` that serve HTTPS (and demand client certs)."""
        for path, what in ((self.cert, "certificate"), (self.key, "key")):
            _read(path, what)
        options: dict[str, Any] = {"ssl_certfile": self.cert, "ssl_keyfile": self.key}
        if self.client_ca:
            _read(self.client_ca, "client CA")
            options |= {"ssl_ca_certs": self.client_ca, "ssl_cert_reqs": ssl.CERT_REQUIRED}
        return options


@dataclass(frozen=True, kw_only=True, slots=True)
class ClientTLS:
    """Roots to verify servers with, and optionally this client's certificate and key."""

    ca: str
    cert: str | None = None
    key: str | None = None

    def __post_init__(self) -> None:
        _pair(self.cert, self.key, "client TLS")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ClientTLS | None:
        env = os.environ if environ is None else environ
        ca = env.get("PERSIMMON_TLS_CA") or None
        cert = env.get("PERSIMMON_TLS_CLIENT_CERT") or None
        key = env.get("PERSIMMON_TLS_CLIENT_KEY") or None
        if ca is None:
            if cert or key:
                raise ConfigError("PERSIMMON_TLS_CLIENT_CERT/_KEY need PERSIMMON_TLS_CA")
            return None
        return cls(ca=ca, cert=cert, key=key)

    def grpc_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, "CA"),
            private_key=_read(self.key, "client key") if self.key else None,
            certificate_chain=_read(self.cert, "client certificate") if self.cert else None)

    def ssl_context(self) -> ssl.SSLContext:
        """An SSL context for HTTPS clients (httpx ``verify=``)."""
        context = ssl.create_default_context(cadata=_read(self.ca, "CA").decode())
        if self.cert and self.key:
            context.load_cert_chain(self.cert, self.key)
        return context
