"""The scanner's layered decoding finds tokens in every form and every density: sparse and dense
escapes, few and many base64 runs (the two run finders), hex, compressed streams after stray magic
numbers, and binary surroundings. The Scanner is used directly (no proxy): fast, real Hyperscan."""

from __future__ import annotations

import base64
import gzip
import json
import os
import random
from urllib.parse import quote

import pytest

from umbra.policy import deny_all
from umbra.proxy.decode import _JSON_ESCAPE, DENSE, _json_unescape, _unescape
from umbra.proxy.scanner import Scanner
from umbra.proxy.secrets import SecretValue

GHP = "ghp_" + "Zq9Xw8Vu7Ts6Rp5On4Ml3Kj2Ih1Gf0Ed9Cb8A"
HELD = "held-secret-value-7c1e"


@pytest.fixture(scope="module")
def scanner() -> Scanner:
    return Scanner(deny_all().scan_rules, [SecretValue("team/held", HELD)])


def _found(scanner: Scanner, body: bytes, content_type: str = "") -> set[str]:
    return scanner.scan_request(
        b"POST /x HTTP/1.1\r\nHost: t", body, content_type, 1 << 26
    ).rule_ids


def _b64_noise(count: int) -> bytes:
    # `count` separate base64 runs of clean random bytes
    return b" ".join(base64.b64encode(os.urandom(30)) for _ in range(count))


TOKEN = GHP.encode()


@pytest.mark.parametrize(
    "body",
    [
        # JSON escapes, sparse and past DENSE (the whole buffer is then unescaped)
        os.urandom(4096) + b'"' + TOKEN.replace(b"_", b"\\u005f") + b'"' + os.urandom(4096),
        b'{"a": "'
        + b"x\\n" * (DENSE + 10)
        + b'", "t": "'
        + TOKEN.replace(b"_", b"\\u005f")
        + b'"}',
        # percent-encoding, sparse in binary and dense in a form
        os.urandom(5000) + quote(GHP, safe="").encode() + os.urandom(5000),
        b"&".join([b"f=%41%42"] * (DENSE + 10)) + b"&t=" + quote(GHP, safe="").encode(),
        # base64: few runs, many runs (past the sparse run finder), MIME-wrapped, misaligned
        _b64_noise(3) + b" " + base64.b64encode(b"x" + TOKEN),
        _b64_noise(200) + b" " + base64.b64encode(b"xy" + TOKEN) + b" " + _b64_noise(5),
        base64.encodebytes(os.urandom(3000) + TOKEN + os.urandom(3000)),
        b"/p/" + base64.urlsafe_b64encode(b"\xfb\xff" + TOKEN),
        # each tail length (the token ends the run)
        base64.b64encode(TOKEN).rstrip(b"="),
        base64.b64encode(b"a" + TOKEN).rstrip(b"="),
        base64.b64encode(b"ab" + TOKEN).rstrip(b"="),
        # hex, and base64 of hex
        os.urandom(100) + TOKEN.hex().encode() + os.urandom(100),
        base64.b64encode(TOKEN.hex().encode()),
        # a stray gzip magic before the real stream, in binary
        os.urandom(64) + b"\x1f\x8b\x08\x00junk" + os.urandom(64) + gzip.compress(TOKEN),
        # nested: base64 of percent-encoded JSON
        base64.b64encode(quote(json.dumps({"t": GHP}), safe="").encode()),
    ],
)
def test_token_found_in_every_form(scanner: Scanner, body: bytes) -> None:
    assert "builtin:github-token" in _found(scanner, body)


def test_held_secret_found_in_dense_base64(scanner: Scanner) -> None:
    body = _b64_noise(300) + b" " + base64.b64encode(b"zz" + HELD.encode()) + b" " + _b64_noise(3)
    assert "secret:team/held" in _found(scanner, body)


@pytest.mark.parametrize(
    "body",
    [
        os.urandom(1 << 20),
        json.dumps([{"name": f"item{i}", "value": "text", "id": i} for i in range(20000)]).encode(),
        _b64_noise(500),
        b"x\\n\\u0041" * 5000,
    ],
)
def test_clean_bodies_stay_clean(scanner: Scanner, body: bytes) -> None:
    assert _found(scanner, body) == set()


def test_fast_json_unescape_agrees_with_the_regex() -> None:
    pieces = [b"\\", b"n", b"u", b"00", b"41", b"7f", b'"', b"/", b"t", b"\\\\", b"x", b"\xfe"]
    rng = random.Random(7)
    for _ in range(20000):
        text = b"".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        assert _json_unescape(text) == _JSON_ESCAPE.sub(_unescape, text), text
