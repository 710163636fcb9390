"""TLS on a real PS, gRPC and admin: certificates made by the test, plaintext and untrusted
clients refused, mutual TLS refuses a client without a certificate."""

from __future__ import annotations

import ssl

import grpc
import httpx
import numpy as np
import pytest

from clients.admin_client import AdminClient
from clients.ps_client import PSClient
from services.common.auth import ClientSecurity
from services.common.codecs import raw_array
from services.common.errors import Unavailable
from services.common.tls import ClientTLS
from services.common.wire import encode_message
from tests.integration.security.conftest import TOKEN, stream_once, table_state

LOOKUP = encode_message({"tables": ["user"], "counts": [5], "codec": "none",
                         "ids": raw_array(np.arange(5, dtype=np.uint64))}, rid=1)


def server_env(certs, mutual: bool = False) -> dict[str, str]:
    env = {"PERSIMMON_TLS_CERT": str(certs.server_cert), "PERSIMMON_TLS_KEY": str(certs.server_key)}
    return env | ({"PERSIMMON_TLS_CLIENT_CA": str(certs.ca)} if mutual else {})


async def refused(address: str, security: ClientSecurity | None) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stream_once(address, "Lookup", LOOKUP, timeout=3, security=security)
    return err.value.code()


async def test_grpc_over_tls(start_ps, certs):
    ps = await start_ps(env=server_env(certs))
    before = table_state(ps)
    trusted = ClientSecurity(tls=ClientTLS(ca=str(certs.ca)))
    reply = await stream_once(ps.address, "Lookup", LOOKUP, security=trusted)
    assert reply["rows"]["shape"] == [5, 8]
    after = table_state(ps)
    assert after != before  # the lookup created the 5 rows
    assert await refused(ps.address, None) == grpc.StatusCode.UNAVAILABLE  # plaintext
    untrusting = ClientSecurity(tls=ClientTLS(ca=str(certs.other_ca)))
    assert await refused(ps.address, untrusting) == grpc.StatusCode.UNAVAILABLE
    assert table_state(ps) == after


async def test_grpc_mutual_tls_needs_a_client_certificate(start_ps, certs):
    ps = await start_ps(env=server_env(certs, mutual=True) | {"PERSIMMON_TOKEN": TOKEN})
    before = table_state(ps)
    anonymous = ClientSecurity(token=TOKEN, tls=ClientTLS(ca=str(certs.ca)))
    assert await refused(ps.address, anonymous) == grpc.StatusCode.UNAVAILABLE
    assert table_state(ps) == before
    worker = ClientSecurity(token=TOKEN, tls=ClientTLS(ca=str(certs.ca), cert=str(certs.client_cert),
                                                       key=str(certs.client_key)))
    reply = await stream_once(ps.address, "Lookup", LOOKUP, metadata=worker.metadata(),
                              security=worker)
    assert reply["rows"]["shape"] == [5, 8]
    # a certificate does not replace the token
    assert await refused(ps.address, ClientSecurity(tls=worker.tls)) == \
        grpc.StatusCode.UNAUTHENTICATED


async def test_ps_client_over_mutual_tls(start_ps, certs):
    ps = await start_ps(env=server_env(certs, mutual=True))
    tls = ClientTLS(ca=str(certs.ca), cert=str(certs.client_cert), key=str(certs.client_key))
    async with PSClient([ps.address], tls=tls) as client:
        rows = await client.lookup("user", np.arange(7, dtype=np.uint64))
    assert rows.shape == (7, 8)
    with pytest.raises(Unavailable):
        async with PSClient([ps.address], tls=ClientTLS(ca=str(certs.ca)), timeout=3):
            pass


async def test_admin_over_https(start_ps, certs):
    ps = await start_ps(env=server_env(certs) | {"PERSIMMON_TOKEN": TOKEN})
    url = ps.admin_url
    assert url == f"https://127.0.0.1:{ps.admin_port}"
    tls = ClientTLS(ca=str(certs.ca))
    async with AdminClient(url, tls=tls, token=TOKEN) as admin:
        assert await admin.healthy()
        assert (await admin.create_table({"name": "extra", "dim": 2})).name == "extra"
    async with httpx.AsyncClient(timeout=5) as plain:
        with pytest.raises(httpx.HTTPError):
            await plain.get(f"http://127.0.0.1:{ps.admin_port}/healthz")
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            await plain.get(url + "/healthz")  # the system roots do not trust the test CA


async def test_admin_mutual_tls(start_ps, certs):
    ps = await start_ps(env=server_env(certs, mutual=True))
    url = f"https://127.0.0.1:{ps.admin_port}/healthz"
    async with httpx.AsyncClient(verify=ClientTLS(ca=str(certs.ca)).ssl_context(),
                                 timeout=5) as anonymous:
        with pytest.raises((httpx.HTTPError, ssl.SSLError)):
            await anonymous.get(url)
    tls = ClientTLS(ca=str(certs.ca), cert=str(certs.client_cert), key=str(certs.client_key))
    async with httpx.AsyncClient(verify=tls.ssl_context(), timeout=5) as worker:
        assert (await worker.get(url)).json() == {"status": "ok"}
