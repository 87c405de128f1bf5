"""The sandbox's `sandbox.env` as the forwarder writes it: the CVM's values first (a profile
cannot override them), the profiles' shell-quoted, rewritten only on a change, and a failed
fetch leaves the last attested file in place."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from umbra.sandbox.sandbox_env_sync import keep_env_fresh, render, write_if_changed

BASE = {"HTTPS_PROXY": "http://10.0.0.1:3128", "NO_PROXY": "localhost,127.0.0.1"}


def _sourced(path: Path) -> dict[str, str]:
    out = subprocess.run(
        ["env", "-i", "bash", "-c", f"set -a; . {path}; env -0"],
        capture_output=True, check=True,
    ).stdout  # fmt: skip
    return dict(item.split("=", 1) for item in out.decode().split("\0") if "=" in item)


def test_values_are_quoted_and_the_cvm_wins(tmp_path: Path) -> None:
    odd = "a 'quoted' $(touch /tmp/nope) `x` \\ value"
    text = render(BASE, {"HTTPS_PROXY": "http://evil", "ODD": odd, "A_FIRST": "1"})
    assert text.splitlines()[:2] == [
        "HTTPS_PROXY=http://10.0.0.1:3128",
        "NO_PROXY=localhost,127.0.0.1",
    ]
    path = tmp_path / "sandbox.env"
    assert write_if_changed(path, text)
    assert not write_if_changed(path, text)
    env = _sourced(path)
    assert env["ODD"] == odd and env["HTTPS_PROXY"] == BASE["HTTPS_PROXY"] and env["A_FIRST"] == "1"
    assert (path.stat().st_mode & 0o777) == 0o644


def test_attach_then_failure_then_detach(tmp_path: Path) -> None:
    path = tmp_path / "sandbox.env"
    answers: list[dict[str, str] | None] = [{"GH_TOKEN": "umbra-placeholder"}, None, {}]

    async def fetch() -> dict[str, str] | None:
        return answers.pop(0)

    seen: list[dict[str, str]] = []

    async def sleep(_: float) -> None:
        seen.append(_sourced(path))
        if not answers:
            raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(keep_env_fresh(fetch, path, BASE, 3, sleep=sleep))
    assert [e.get("GH_TOKEN") for e in seen] == ["umbra-placeholder", "umbra-placeholder", None]
    assert all(e["HTTPS_PROXY"] == BASE["HTTPS_PROXY"] for e in seen)
