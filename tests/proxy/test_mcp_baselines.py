"""The saved MCP tool-list baselines: round trip, and an unreadable or lying file counts as none
(never a crash at start)."""

from __future__ import annotations

import pytest

from umbra.proxy.addons.mcp import baselines_from_json, baselines_to_json


def test_baselines_round_trip() -> None:
    approved = {("team", "mcp.test", 443, "/mcp"): {"echo": "ab" * 32}}
    assert baselines_from_json(baselines_to_json(approved)) == approved


@pytest.mark.parametrize(
    "raw",
    [
        b"", b"{", b"[]", b'{"version": 2, "baselines": []}', b'{"version": 1}',
        b'{"version": 1, "baselines": [["t", "h", "443", "/", {}]]}',
        b'{"version": 1, "baselines": [["t", "h", true, "/", {}]]}',
        b'{"version": 1, "baselines": [["t", "h", 443, "/", {"echo": 1}]]}',
        b'{"version": 1, "baselines": [["t", "h", 443]]}',
        b"[" * 100_000,
    ],
)  # fmt: skip
def test_an_unreadable_or_lying_file_counts_as_none(raw: bytes) -> None:
    assert baselines_from_json(raw) == {}
