"""Credential injection: only for the bound connect target, never echoed back, never redirected."""

from __future__ import annotations

import base64

from tests.proxy.conftest import Env
from tests.proxy.harness import (
    ALICE_SECRET,
    BOB_SECRET,
    BOB_TOKEN,
    TEAM_SECRET,
    connect_tunnel,
    curl,
    curl_status,
    read_response,
    status_of,
)


def test_sandbox_supplied_header_is_replaced_in_every_case(env: Env) -> None:
    sock, _ = connect_tunnel(env.proxy, f"api.test:{env.origin.port}", sni="api.test")
    sock.sendall(
        f"GET /replace HTTP/1.1\r\nHost: api.test:{env.origin.port}\r\n"
        "authorization: Bearer umbra-placeholder:team/github-bot\r\nAUTHORIZATION: Basic Zm9vOmJhcg==\r\n\r\n".encode()
    )
    response = read_response(sock)
    assert status_of(response) == 200
    seen = [s for s in env.recorder.snapshot() if s.path == "/replace"][-1]
    assert seen.header("authorization") == [f"Bearer {TEAM_SECRET}"]
    assert TEAM_SECRET.encode() not in response


def test_no_injection_for_other_allowed_host(env: Env) -> None:
    result = curl(env.proxy, f"https://other.test:{env.origin.port}/no-inject")
    assert curl_status(result) == 200
    seen = [s for s in env.recorder.snapshot() if s.path == "/no-inject"][-1]
    assert not seen.header("authorization")


def test_personal_secrets_resolve_per_owner(env: Env) -> None:
    alice = curl(env.proxy, f"https://ai.test:{env.origin.port}/personal-alice")
    bob = curl(
        env.proxy, f"https://ai.test:{env.origin.port}/personal-bob", cvm="cvm-bob", token=BOB_TOKEN
    )
    assert curl_status(alice) == 200 and curl_status(bob) == 200
    seen = {s.path: s for s in env.recorder.snapshot()}
    assert seen["/personal-alice"].header("x-api-key") == [ALICE_SECRET]
    assert seen["/personal-bob"].header("x-api-key") == [BOB_SECRET]


def test_response_reflecting_credential_is_not_passed_back(env: Env) -> None:
    """The body streams through the reflection guard: a hit cuts the stream (no complete 200)."""
    mark = env.proxy.log.mark()
    result = curl(env.proxy, f"https://api.test:{env.origin.port}/reflect")
    assert result.returncode != 0
    assert TEAM_SECRET not in result.stdout
    env.proxy.log.wait_for(mark, lambda r: r["reason"] == "credential_reflected")


def test_response_reflecting_credential_base64_is_not_passed_back(env: Env) -> None:
    mark = env.proxy.log.mark()
    result = curl(env.proxy, f"https://api.test:{env.origin.port}/reflect-b64")
    assert result.returncode != 0
    assert base64.b64encode(f"Bearer {TEAM_SECRET}".encode()).decode() not in result.stdout
    assert "QmVhcmVy" not in result.stdout  # not even the start of the encoded header
    env.proxy.log.wait_for(mark, lambda r: r["reason"] == "credential_reflected")


def test_response_reflecting_credential_in_a_header_is_refused(env: Env) -> None:
    mark = env.proxy.log.mark()
    result = curl(env.proxy, f"https://api.test:{env.origin.port}/reflect-header", "-i")
    assert curl_status(result) != 200
    assert TEAM_SECRET not in result.stdout
    env.proxy.log.wait_for(mark, lambda r: r["reason"] == "credential_reflected")


def test_redirect_to_other_host_carries_no_credential(env: Env) -> None:
    """The client follows a redirect; the follow-up is a new decision, for a host with no binding."""
    mark = env.proxy.log.mark()
    target = f"https://evil.test:{env.origin.port}/stolen"
    result = curl(env.proxy, f"https://api.test:{env.origin.port}/redirect?to={target}", "-L")
    assert curl_status(result) == 403
    assert not any(s.path == "/stolen" for s in env.recorder.snapshot())
    env.proxy.log.wait_for(
        mark, lambda r: r["decision"] == "deny" and r["reason"] == "no_matching_rule"
    )


def test_redirect_to_allowed_unbound_host_carries_no_credential(env: Env) -> None:
    target = f"https://other.test:{env.origin.port}/landed"
    result = curl(env.proxy, f"https://api.test:{env.origin.port}/redirect?to={target}", "-L")
    assert curl_status(result) == 200
    landed = [s for s in env.recorder.snapshot() if s.path == "/landed"][-1]
    assert not landed.header("authorization")


def test_no_injection_over_plain_http(env: Env) -> None:
    mark = env.proxy.log.mark()
    result = curl(env.proxy, f"http://plain.test:{env.plain.port}/plain-inject")
    assert curl_status(result) == 403
    assert not env.recorder.contains(b"/plain-inject")
    env.proxy.log.wait_for(mark, lambda r: r["reason"] == "injection_requires_tls")


def test_alt_svc_is_stripped_so_clients_never_try_quic(env: Env) -> None:
    result = curl(env.proxy, f"https://other.test:{env.origin.port}/altsvc", "-D", "-")
    assert curl_status(result) == 200
    assert "alt-svc" not in result.stdout.lower()


def test_profile_less_cvm_is_denied_everything(env: Env) -> None:
    mark = env.proxy.log.mark()
    result = curl(
        env.proxy,
        f"https://other.test:{env.origin.port}/carol",
        cvm="cvm-nothing",
        token="carol-credential",
    )
    assert curl_status(result) == 403
    assert not env.recorder.contains(b"/carol")
    env.proxy.log.wait_for(
        mark, lambda r: r["reason"] == "no_policy" and r["cvm_id"] == "cvm-nothing"
    )


def test_unknown_identity_is_denied(env: Env) -> None:
    mark = env.proxy.log.mark()
    result = curl(env.proxy, f"https://other.test:{env.origin.port}/who", token="wrong")
    assert curl_status(result) in (0, 407)
    assert not env.recorder.contains(b"/who")
    env.proxy.log.wait_for(mark, lambda r: r["reason"] == "unknown_identity")


def test_missing_identity_is_denied(env: Env) -> None:
    import socket

    mark = env.proxy.log.mark()
    sock = socket.create_connection(("127.0.0.1", env.proxy.port), timeout=10)
    sock.sendall(
        f"CONNECT other.test:{env.origin.port} HTTP/1.1\r\nHost: other.test\r\n\r\n".encode()
    )
    assert status_of(read_response(sock)) == 407
    env.proxy.log.wait_for(mark, lambda r: r["reason"] == "unknown_identity")
