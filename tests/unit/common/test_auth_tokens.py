"""Token loading and checking, client security settings, TLS settings from the environment."""

from __future__ import annotations

import pytest

from services.common.auth import (
    ClientSecurity,
    ServerSecurity,
    check_authorization,
    is_loopback,
    load_token,
)
from services.common.errors import ConfigError, PermissionDenied, Unauthenticated
from services.common.rpc import _client_host
from services.common.tls import ClientTLS, ServerTLS


def test_token_precedence_argument_then_env_then_file(tmp_path):
    f = tmp_path / "token"
    f.write_text("from-file\n")
    env = {"PERSIMMON_TOKEN": "from-env", "PERSIMMON_TOKEN_FILE": str(f)}
    assert load_token("given", environ=env) == "given"
    assert load_token(token_file=f, environ=env) == "from-file"
    assert load_token(environ=env) == "from-env"
    assert load_token(environ={"PERSIMMON_TOKEN_FILE": str(f)}) == "from-file"
    assert load_token(environ={}) is None
    assert load_token(environ={"PERSIMMON_TOKEN": ""}) is None


@pytest.mark.parametrize("bad, words", [("", "empty"), ("  \n", "empty"),
                                        ("two words", "printable ASCII"), ("é", "printable")])
def test_bad_tokens_are_config_errors(bad, words):
    with pytest.raises(ConfigError, match=words):
        load_token(bad)


def test_missing_token_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read token file"):
        load_token(environ={"PERSIMMON_TOKEN_FILE": str(tmp_path / "absent")})


@pytest.mark.parametrize("header, error", [
    (None, Unauthenticated), ("", Unauthenticated), ("Bearer", Unauthenticated),
    ("Bearer   ", Unauthenticated), ("Basic abc", Unauthenticated), ("abc", Unauthenticated),
    ("Bearer abd", PermissionDenied), ("Bearer ab", PermissionDenied),
    ("Bearer abcd", PermissionDenied),
])
def test_check_authorization_refuses(header, error):
    with pytest.raises(error):
        check_authorization(header, "abc")


@pytest.mark.parametrize("header", ["Bearer abc", "bearer abc", "BEARER  abc ", " Bearer abc"])
def test_check_authorization_accepts(header):
    check_authorization(header, "abc")


def test_client_security_sends_the_token_only_when_there_is_one():
    with_token = ClientSecurity.resolve(environ={"PERSIMMON_TOKEN": "t0k"})
    assert with_token.metadata() == (("authorization", "Bearer t0k"),)
    assert with_token.headers() == {"Authorization": "Bearer t0k"}
    assert ClientSecurity.resolve(token="arg", environ={"PERSIMMON_TOKEN": "t0k"}).token == "arg"
    none = ClientSecurity.resolve(environ={})
    assert none.metadata() is None and none.headers() == {} and none.tls is None


def test_tls_settings_from_the_environment():
    env = {"PERSIMMON_TLS_CERT": "s.pem", "PERSIMMON_TLS_KEY": "s.key",
           "PERSIMMON_TLS_CLIENT_CA": "ca.pem", "PERSIMMON_TOKEN": "x"}
    server = ServerSecurity.from_env(env)
    assert server.token == "x" and server.tls == ServerTLS(cert="s.pem", key="s.key",
                                                           client_ca="ca.pem")
    assert ServerTLS.from_env({}) is None and ClientTLS.from_env({}) is None
    client = ClientTLS.from_env({"PERSIMMON_TLS_CA": "ca.pem", "PERSIMMON_TLS_CLIENT_CERT": "c",
                                 "PERSIMMON_TLS_CLIENT_KEY": "k"})
    assert client == ClientTLS(ca="ca.pem", cert="c", key="k")


@pytest.mark.parametrize("env, words", [
    ({"PERSIMMON_TLS_CERT": "s.pem"}, "both the certificate and its key"),
    ({"PERSIMMON_TLS_CLIENT_CA": "ca.pem"}, "needs PERSIMMON_TLS_CERT"),
])
def test_incomplete_server_tls_is_a_config_error(env, words):
    with pytest.raises(ConfigError, match=words):
        ServerTLS.from_env(env)


def test_incomplete_client_tls_is_a_config_error():
    with pytest.raises(ConfigError, match="need PERSIMMON_TLS_CA"):
        ClientTLS.from_env({"PERSIMMON_TLS_CLIENT_CERT": "c", "PERSIMMON_TLS_CLIENT_KEY": "k"})
    with pytest.raises(ConfigError, match="both"):
        ClientTLS(ca="ca.pem", cert="c")


def test_unreadable_certificates_are_config_errors(tmp_path):
    tls = ServerTLS(cert=str(tmp_path / "none.pem"), key=str(tmp_path / "none.key"))
    with pytest.raises(ConfigError, match="cannot read the TLS"):
        tls.grpc_credentials()
    with pytest.raises(ConfigError, match="cannot read the TLS"):
        tls.uvicorn_options()


@pytest.mark.parametrize("peer, host", [("ipv4:127.0.0.1:5678", "127.0.0.1"),
                                        ("ipv6:[::1]:5678", "::1"), ("unix:/tmp/s", "/tmp/s")])
def test_client_host_of_a_peer(peer, host):
    assert _client_host(peer) == host


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("::1", True), ("[::1]", True),
                                            ("localhost", True), ("0.0.0.0", False),
                                            ("10.1.2.3", False), ("ps-0.example", False)])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback
