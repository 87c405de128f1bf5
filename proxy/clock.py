"""The test-only clock (`--test-clock FILE`): the time plus the seconds the file holds, read at
each use, so a test moves budget windows (a minute, a day) forward without waiting. A file that
is missing or does not hold a finite number counts as no offset (it only ever serves tests)."""

from __future__ import annotations

import math
import time
from pathlib import Path


class OffsetClock:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self) -> float:
        try:
            offset = float(self.path.read_text().strip() or 0)
        except (OSError, ValueError):
            offset = 0.0
        return time.time() + (offset if math.isfinite(offset) else 0.0)
