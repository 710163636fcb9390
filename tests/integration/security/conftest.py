"""Security fixtures: a private CA with server and client certificates made by the test run,
and a PS shard started under given ``PERSIMMON_*`` security settings."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from services.common.auth import ClientSecurity
from services.common.rpc import open_channel
from services.common.wire import decode_message
from services.ps.config import PSConfig
from services.ps.service import PSService
from tests.integration.ps.conftest import table_configs

TOKEN = "s3cret-token.for_tests"


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # a CA that signed nothing here: trusting it must fail


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return path


def _write_cert(cert: x509.Certificate, path: Path) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _ca(common_name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(_name(common_name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def _leaf(ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, common_name: str,
          usage: x509.ObjectIdentifier) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(_name(common_name))
               .issuer_name(ca_cert.subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
    if usage == ExtendedKeyUsageOID.SERVER_AUTH:
        builder = builder.add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate."""
    d = tmp_path_factory.mktemp("certs")
    ca_key, ca_cert = _ca("persimmon test CA")
    server_key, server_cert = _leaf(ca_key, ca_cert, "persimmon server",
                                    ExtendedKeyUsageOID.SERVER_AUTH)
    client_key, client_cert = _leaf(ca_key, ca_cert, "persimmon worker",
                                    ExtendedKeyUsageOID.CLIENT_AUTH)
    _, other_ca = _ca("some other CA")
    return Certs(ca=_write_cert(ca_cert, d / "ca.pem"),
                 server_cert=_write_cert(server_cert, d / "server.pem"),
                 server_key=_write_key(server_key, d / "server.key"),
                 client_cert=_write_cert(client_cert, d / "client.pem"),
                 client_key=_write_key(client_key, d / "client.key"),
                 other_ca=_write_cert(other_ca, d / "other-ca.pem"))


@pytest.fixture
async def start_ps(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Callable[..., object]]:
    """``await start_ps(env={...}, **PSConfig fields)``: one shard started with those
    ``PERSIMMON_*`` variables set (they are unset again once it runs, so the test's own
    clients get only what the test gives them)."""
    started: list[PSService] = []

    async def start(env: dict[str, str] | None = None, **config: object) -> PSService:
        service = PSService(PSConfig(grpc_port=0, admin_port=0, tables=table_configs(),
                                     **config))  # type: ignore[arg-type]
        with monkeypatch.context() as patch:
            for key, value in (env or {}).items():
                patch.setenv(key, value)
            await service.start()
        started.append(service)
        return service

    yield start
    for service in started:
        await service.close()


def table_state(service: PSService) -> dict[str, tuple[str, int]]:
    """Every table of the shard with the sha256 of all its rows and optimizer state."""
    return {name: (table.content_digest(), table.num_rows)
            for name, table in sorted(service.shard.tables.items())}


async def stream_once(address: str, method: str, raw: bytes, metadata=None,
                      timeout: float = 10.0, security: ClientSecurity | None = None) -> dict:
    """Send one raw message on a PS stream and return the decoded reply (errors raise)."""
    async with open_channel(address, security) as channel:
        call = channel.stream_stream(f"/persimmon.PS/{method}")(metadata=metadata,
                                                                 timeout=timeout)
        await call.write(raw)
        await call.done_writing()
        reply = await call.read()
        if reply is grpc.aio.EOF:
            await call  # raises the call's status
            raise AssertionError(f"{method} ended without a reply")
        return decode_message(reply)
