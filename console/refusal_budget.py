"""How many enrollment refusals are audited one by one: `ENROLL_REFUSALS_PER_MINUTE` per team
key (`-` for unknown tokens, i.e. anyone on the network) per minute and process; past it, the
refusals of that minute are counted and written as one `cvm.enroll_refused_summary` entry
(`{"window_start", "seconds", "refused", "reasons": {reason: count}}`) once the minute is over.

A flood of random tokens used to append one hash-chained entry per request under the audit
chain's lock, slowing every audited write; now it costs at most N entries plus one summary a
minute. Summaries of ended minutes are written by the next refusal of that key, by the Console's
periodic flush and at shutdown (`drain(final=True)` includes the current minute).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from threading import Lock
from typing import TYPE_CHECKING

from sqlalchemy.orm import Session

from umbra.console import audit
from umbra.console.enums import AuditAction

if TYPE_CHECKING:
    from umbra.console.state import Console

WINDOW_SECONDS = 60


@dataclass(frozen=True)
class Summary:
    team: str
    window_start: datetime
    reasons: dict[str, int]

    def details(self) -> dict[str, object]:
        return {
            "window_start": self.window_start.isoformat(),
            "seconds": WINDOW_SECONDS,
            "refused": sum(self.reasons.values()),
            "reasons": dict(sorted(self.reasons.items())),
        }


@dataclass
class _Window:
    index: int
    admitted: int = 0
    suppressed: Counter[str] = field(default_factory=Counter)


class RefusalBudget:
    def __init__(self, per_minute: int, clock: Callable[[], float] = time.time) -> None:
        self.per_minute = per_minute
        self._clock = clock
        self._windows: dict[str, _Window] = {}
        self._lock = Lock()

    def admit(self, team: str, reason: str) -> tuple[bool, list[Summary]]:
        """Whether to audit this refusal on its own, and the ended windows' summaries to write
        (in the same transaction)."""
        now = int(self._clock() // WINDOW_SECONDS)
        with self._lock:
            window = self._windows.get(team)
            summaries: list[Summary] = []
            if window is None or window.index != now:
                if window is not None and window.suppressed:
                    summaries.append(_summary(team, window))
                window = self._windows[team] = _Window(now)
            if window.admitted < self.per_minute:
                window.admitted += 1
                return True, summaries
            window.suppressed[reason] += 1
            return False, summaries

    def drain(self, *, final: bool = False) -> list[Summary]:
        """Summaries of every ended window (and of the current ones when `final`)."""
        now = int(self._clock() // WINDOW_SECONDS)
        with self._lock:
            summaries = [
                _summary(team, window)
                for team, window in self._windows.items()
                if window.suppressed and (final or window.index != now)
            ]
            self._windows = {
                team: window
                for team, window in self._windows.items()
                if window.index == now and not final
            }
            return summaries


def _summary(team: str, window: _Window) -> Summary:
    start = datetime.fromtimestamp(window.index * WINDOW_SECONDS, UTC)
    return Summary(team=team, window_start=start, reasons=dict(window.suppressed))


def write_summaries(session: Session, summaries: list[Summary]) -> None:
    for summary in summaries:
        audit.append(
            session, actor="umbra-console", team=summary.team,
            action=AuditAction.cvm_enroll_refused_summary, target="-", details=summary.details(),
        )  # fmt: skip


def flush(console: Console, *, final: bool = False) -> int:
    """Write the summaries of ended minutes (all of them at shutdown); returns how many."""
    summaries = console.refusals.drain(final=final)
    if summaries:
        with console.write() as session:
            write_summaries(session, summaries)
    return len(summaries)
