"""Budgets (policy.md, Budgets): an allowed request that a budget covers is refused with 429
`budget_exceeded` once the budget's counter for its CVM (or owner) has reached the limit; else it
is counted (a request now, its bytes sent and received and its LLM tokens when it ends).

Counters live in this proxy process (each worker and each replica counts on its own) and are
saved to `budgets.json` in its spool directory at most once a second and at shutdown, written
atomically; a restart loads them, so a budget reached stays reached (at most the last second's
counts are lost).
"""

from __future__ import annotations

import logging
from pathlib import Path

from mitmproxy import http

from umbra.contracts.files import write_atomic
from umbra.policy.budgets import BudgetBook, Metric, budgets_for
from umbra.proxy.addons.base import Denied, Shared, UmbraAddon, deny, guard
from umbra.proxy.addons.reasons import Reason
from umbra.proxy.addons.state import flow_state

logger = logging.getLogger("umbra.proxy")
SAVE_INTERVAL = 1.0
FILE_NAME = "budgets.json"
_UNITS = {
    Metric.REQUESTS: "requests a minute",
    Metric.BYTES: "bytes a day",
    Metric.TOKENS: "tokens a month",
}


class Budgets(UmbraAddon):
    def __init__(self, shared: Shared, path: Path | None = None) -> None:
        super().__init__(shared)
        self.path = path
        self.book = BudgetBook()
        self._saved = 0.0
        if path is not None and path.exists():
            self.book = BudgetBook.from_json(path.read_bytes(), shared.clock())

    @guard
    def requestheaders(self, flow: http.HTTPFlow) -> None:
        fstate = flow_state(flow)
        decision = fstate.decision
        if fstate.denied or decision is None or not decision.allowed or fstate.effective is None:
            return
        budgets = budgets_for(
            fstate.effective.policy.budgets, decision.host or "", decision.rule_id
        )
        if not budgets:
            return
        identity = self.shared.conns.get(flow.client_conn).identity
        subjects = {
            "cvm": identity.cvm_id if identity is not None else "?",
            "owner": identity.owner if identity is not None else "?",
        }
        now = self.shared.clock()
        reached = self.book.exhausted(budgets, subjects, now)
        if reached is not None:
            budget, metric, limit = reached
            detail = f"budget {budget.id}: {limit} {_UNITS[metric]} per {budget.per} reached"
            deny(self.shared, flow, Denied(Reason.BUDGET_EXCEEDED, detail, budget.id))
            return
        self.book.charge(budgets, subjects, Metric.REQUESTS, 1, now)
        fstate.budgets = (tuple(budgets), subjects)
        self._maybe_save(now)

    @guard
    def response(self, flow: http.HTTPFlow) -> None:
        self._settle(flow)

    @guard
    def error(self, flow: http.HTTPFlow) -> None:
        self._settle(flow)

    def _settle(self, flow: http.HTTPFlow) -> None:
        """Charge what an admitted exchange spent, once, when it ends."""
        fstate = flow_state(flow)
        if fstate.budgets is None:
            return
        budgets, subjects = fstate.budgets
        fstate.budgets = None
        now = self.shared.clock()
        sent = len(flow.request.raw_content or b"")
        received = fstate.response_bytes or (
            len(flow.response.raw_content or b"") if flow.response is not None else 0
        )
        self.book.charge(budgets, subjects, Metric.BYTES, sent + received, now)
        usage = fstate.llm_usage
        tokens = sum(
            int(value)
            for name in ("llm_input_tokens", "llm_output_tokens")
            if isinstance(value := usage.get(name), int)
        )
        self.book.charge(budgets, subjects, Metric.TOKENS, tokens, now)
        self._maybe_save(now)

    def _maybe_save(self, now: float, force: bool = False) -> None:
        if self.path is None or not self.book.dirty:
            return
        if not force and now - self._saved < SAVE_INTERVAL:
            return
        try:
            write_atomic(self.path, self.book.to_json(now), 0o600)
            self.book.dirty = False
            self._saved = now
        except OSError as exc:
            logger.error("budget counters not saved to %s (%s)", self.path, exc.strerror)

    def done(self) -> None:
        self._maybe_save(self.shared.clock(), force=True)
