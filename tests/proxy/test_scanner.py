"""The scanner's layered decoding finds tokens in every form and every density: sparse and dense
escapes, few and many base64 runs (the two run finders), hex, compressed streams after stray magic
numbers, and binary surroundings. The Scanner is used directly (no proxy): fast, real Hyperscan."""

from __future__ import annotations

import base64
import gzip
import json
import os
import random
from pathlib import Path
from urllib.parse import quote

import pytest

import umbra.proxy.decode
from umbra.policy import deny_all
from umbra.proxy.decode import _JSON_ESCAPE, DENSE, MAX_DEPTH, _json_unescape, _unescape
from umbra.proxy.scanner import ScanError, Scanner
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


def _b64(data: bytes, times: int) -> bytes:
    for _ in range(times):
        data = base64.b64encode(data)
    return data


def _mixed(data: bytes) -> bytes:
    """base64 8 times, interleaved with hex, URL-encoding and JSON escapes (12 layers)."""
    data = _b64(data, 2)
    data = data.hex().encode()
    data = _b64(data, 2)
    data = quote(json.dumps({"v": data.decode()}), safe="").encode()
    data = _b64(data, 2)
    data = json.dumps({"w": data.decode().replace("A", "\\u0041")}).encode()
    return _b64(data, 2)


@pytest.mark.parametrize("times", [4, 5, 8])
def test_token_in_base64_nested_past_the_old_depth_is_found(scanner: Scanner, times: int) -> None:
    """Fails on the old code: its decoding stopped silently after 3 levels, so base64 nested 4
    times or more passed unscanned."""
    assert "builtin:github-token" in _found(scanner, _b64(TOKEN, times))
    assert "secret:team/held" in _found(scanner, b'{"x": "' + _b64(HELD.encode(), times) + b'"}')


def test_token_in_base64_mixed_with_hex_url_and_json_escapes_is_found(scanner: Scanner) -> None:
    """Fails on the old code (depth 3)."""
    assert "builtin:github-token" in _found(scanner, _mixed(TOKEN))
    assert "secret:team/held" in _found(scanner, os.urandom(500) + _mixed(HELD.encode()))


def _percent(data: bytes, times: int) -> bytes:
    for _ in range(times):
        data = quote(data, safe="").encode()
    return data


@pytest.mark.parametrize(
    "body",
    [
        _b64(b"nothing to see here, just text", MAX_DEPTH + 2),
        # percent-encoding the percent signs again and again: each level is still encoded
        _percent(b'{"t": "x"}', MAX_DEPTH + 2),
    ],
    ids=["base64", "percent"],
)
def test_content_still_encoded_past_the_depth_is_refused_not_passed(
    scanner: Scanner, body: bytes
) -> None:
    """Fails on the old code, which forwarded whatever lay below its last level unscanned."""
    with pytest.raises(ScanError) as caught:
        _found(scanner, body)
    assert caught.value.reason == "scan_limit"


def test_source_code_in_json_and_in_a_form_decodes_to_the_end_and_stays_clean(
    scanner: Scanner,
) -> None:
    """The proxy's own source (percent signs, JSON escapes and character references side by side,
    long identifiers) as an LLM prompt, twice JSON-encoded, and form-encoded: every level is
    decoded and nothing is refused. Fails with each kind decoded into its own piece at every level
    (each piece carries the other kinds' triggers: the levels grew threefold until the budget
    refused the request)."""
    source = "".join(
        path.read_text() for path in sorted(Path(umbra.proxy.decode.__file__).parent.glob("*.py"))
    )
    prompt = json.dumps({"messages": [{"role": "user", "content": source}]})
    for body in (
        prompt.encode(),
        json.dumps({"payload": prompt}).encode(),
        b"payload=" + quote(prompt).encode(),
    ):
        assert _found(scanner, body) == set()
