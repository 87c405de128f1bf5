"""Budgets: which budgets cover a request, and the counters that enforce them.

Pure: the proxy keeps a `BudgetBook` per process, persists it (`to_json`/`from_json`) and charges
it; `policy test` asks `budgets_for` which budgets cover a request. Windows are fixed and UTC:
the minute (`requests_per_minute`), the day (`bytes_per_day`) and the month (`tokens_per_month`).
A request is refused when a counter has reached its limit (the request that crosses a byte or
token limit completes: its size is known only at its end).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum

from umbra.policy.compiled import CompiledBudget
from umbra.policy.matcher import host_keys

MAX_COUNTERS = 100_000


class Metric(StrEnum):
    REQUESTS = "requests"
    BYTES = "bytes"
    TOKENS = "tokens"


_LIMIT = {
    Metric.REQUESTS: "requests_per_minute",
    Metric.BYTES: "bytes_per_day",
    Metric.TOKENS: "tokens_per_month",
}


def window(metric: Metric, now: float) -> str:
    moment = datetime.fromtimestamp(now, UTC)
    if metric is Metric.REQUESTS:
        return moment.strftime("%Y-%m-%dT%H:%M")
    if metric is Metric.BYTES:
        return moment.strftime("%Y-%m-%d")
    return moment.strftime("%Y-%m")


def budgets_for(
    budgets: Iterable[CompiledBudget], host: str, rule_id: str | None
) -> list[CompiledBudget]:
    """The budgets covering a request to a normalized `host` that `rule_id` allowed."""
    keys = set(host_keys(host))
    return [
        budget
        for budget in budgets
        if (budget.hosts is not None and keys.intersection(budget.hosts))
        or (budget.rules is not None and rule_id in budget.rules)
    ]


def limit_of(budget: CompiledBudget, metric: Metric) -> int | None:
    value = getattr(budget, _LIMIT[metric])
    return int(value) if value is not None else None


@dataclass
class BudgetBook:
    """Counters keyed by (budget, subject, metric, window): subject is a CVM id or an owner."""

    counters: dict[tuple[str, str, str, str], int] = field(default_factory=dict)
    dirty: bool = False

    def used(self, budget: CompiledBudget, subject: str, metric: Metric, now: float) -> int:
        return self.counters.get((budget.id, subject, metric, window(metric, now)), 0)

    def exhausted(
        self, budgets: Sequence[CompiledBudget], subjects: dict[str, str], now: float
    ) -> tuple[CompiledBudget, Metric, int] | None:
        """The first budget whose counter for this request's subject has reached its limit."""
        for budget in budgets:
            subject = subjects[budget.per]
            for metric in Metric:
                limit = limit_of(budget, metric)
                if limit is not None and self.used(budget, subject, metric, now) >= limit:
                    return budget, metric, limit
        return None

    def charge(
        self,
        budgets: Sequence[CompiledBudget],
        subjects: dict[str, str],
        metric: Metric,
        amount: int,
        now: float,
    ) -> None:
        if amount <= 0:
            return
        for budget in budgets:
            if limit_of(budget, metric) is None:
                continue
            key = (budget.id, subjects[budget.per], str(metric), window(metric, now))
            self.counters[key] = self.counters.get(key, 0) + amount
            self.dirty = True
        if len(self.counters) > MAX_COUNTERS:
            self.prune(now)

    def prune(self, now: float) -> None:
        """Drop counters of windows that have passed."""
        current = {metric: window(metric, now) for metric in Metric}
        self.counters = {
            key: value for key, value in self.counters.items() if key[3] == current[Metric(key[2])]
        }
        self.dirty = True

    def to_json(self, now: float) -> bytes:
        self.prune(now)
        rows = [[*key, value] for key, value in sorted(self.counters.items())]
        return json.dumps({"version": 1, "counters": rows}, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes, now: float) -> BudgetBook:
        """A book from its saved form; anything unreadable in it is dropped, never trusted more
        than nothing (a lost counter admits at most one window's budget again)."""
        book = cls()
        try:
            document = json.loads(raw)
            rows = document["counters"] if document.get("version") == 1 else []
        except (ValueError, TypeError, KeyError, AttributeError):
            return book
        for row in rows if isinstance(rows, list) else []:
            if (
                isinstance(row, list)
                and len(row) == 5
                and all(isinstance(part, str) for part in row[:4])
                and row[2] in set(Metric)
                and isinstance(row[4], int)
                and not isinstance(row[4], bool)
                and row[4] >= 0
            ):
                book.counters[(row[0], row[1], row[2], row[3])] = row[4]
        book.prune(now)
        book.dirty = False
        return book
