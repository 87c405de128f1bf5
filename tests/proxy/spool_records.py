"""Reading a traffic spool back, for tests (the proxy itself only ships it: `proxy/spool.py`)."""

from __future__ import annotations

import json
from pathlib import Path

from umbra.proxy.spool import segments


def read_records(directory: Path) -> list[dict[str, object]]:
    """Every complete record in the spool, oldest first (a torn last line is skipped)."""
    out: list[dict[str, object]] = []
    for path in segments(directory):
        for line in path.read_bytes().split(b"\n"):
            if line:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
    return out
