"""The forwarder's side of the `env` answer: only what a profile may set gets through, and a bad
answer is refused whole with the variable's name (never its value)."""

from __future__ import annotations

import asyncio
import struct

import pytest

from umbra.contracts.sandbox_env import RESERVED_ENV, check_env
from umbra.contracts.tunnel_header import (
    MAX_ENV_REPLY,
    HeaderError,
    encode_env_reply,
    read_env_reply,
)


def _read(data: bytes) -> dict[str, str]:
    async def go() -> dict[str, str]:
        buf = bytearray(data)

        async def recv(n: int) -> bytes:
            chunk = bytes(buf[:n])
            del buf[:n]
            return chunk

        return await read_env_reply(recv)

    return asyncio.run(go())


def test_a_profiles_environment_is_read_as_sent() -> None:
    env = {"CLAUDE_CODE_OAUTH_TOKEN": "umbra-placeholder:personal/x", "Q": "it's $HOME"}
    assert _read(encode_env_reply(env)) == env
    assert _read(encode_env_reply({})) == {}


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ({"PATH": "/tmp/x"}, "PATH is set by the sandbox itself"),
        ({"LD_PRELOAD": "/tmp/x.so"}, "LD_PRELOAD is set by the sandbox itself"),
        ({"HTTPS_PROXY": "http://x:1"}, "HTTPS_PROXY is set by the sandbox itself"),
        ({"https_proxy": "http://x:1"}, "https_proxy is set by the sandbox itself"),
        ({"NODE_EXTRA_CA_CERTS": "/tmp/ca"}, "NODE_EXTRA_CA_CERTS is set by the sandbox"),
        ({"A-B": "1"}, "variable name 'A-B' does not match"),
        ({"X=$(id)": "1"}, "does not match"),
        ({"": "1"}, "variable name '' does not match"),
        ({"OK": "a\nPATH=/tmp/x"}, "OK: contains a control character"),
        ({"OK": "x" * 4097}, "OK: longer than 4096 characters"),
    ],
)
def test_an_answer_with_one_bad_variable_is_refused_whole(env: dict[str, str], reason: str) -> None:
    # The Security CVM's own encoder does not check: the forwarder must.
    with pytest.raises(HeaderError) as info:
        _read(encode_env_reply({"GOOD": "1", **env}))
    assert str(info.value).startswith("env reply refused: ") and reason in str(info.value)
    assert "/tmp/x" not in str(info.value)


def test_malformed_or_oversized_answers_are_refused() -> None:
    for data, reason in [
        (struct.pack(">I", 5) + b"{nope", "env reply is not JSON"),
        (struct.pack(">I", 2) + b"[]", "env reply is not an object of strings"),
        (struct.pack(">I", 8) + b'{"A": 1}', "env reply is not an object of strings"),
        (struct.pack(">I", MAX_ENV_REPLY + 1), f"length {MAX_ENV_REPLY + 1} is outside"),
        (struct.pack(">I", 0), "length 0 is outside"),
        (struct.pack(">I", 10) + b"{}", "connection closed before the whole env reply"),
    ]:
        with pytest.raises(HeaderError, match=reason):
            _read(data)


def test_every_reserved_name_is_refused() -> None:
    for name in RESERVED_ENV:
        with pytest.raises(ValueError, match=f"{name} is set by the sandbox itself"):
            check_env({name: "x"})
