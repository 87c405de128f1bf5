"""Enrollment under contention, on PostgreSQL with real parallel clients: a copied token can only
race the genuine CVM, never block it, and anonymous callers cannot grow the audit log.

Before stateless nonces every challenge replaced the token's one stored nonce and every refusal
cleared it: six parallel enrollments with one token all failed `wrong_nonce`, and a client
polling `/enroll/challenge` every 50 ms made each genuine enrollment fail.
"""

from __future__ import annotations

import base64
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from sqlalchemy import func, select
from sqlmodel import col

from tests.console import enroll
from umbra.attest.simulator import SimulatedTdx
from umbra.console import enrollment, refusal_budget
from umbra.console.models import AuditEntry, utcnow
from umbra.console.refusal_budget import RefusalBudget
from umbra.contracts.enrollment import report_data

from .helpers import Team

PARALLEL = 6


def _attempt(client: httpx.Client, token: str, cvm_id: str, pause: float = 0.0) -> httpx.Response:
    """One complete enrollment as a genuine TD does it: challenge, quote, enroll."""
    challenge = client.post("/api/v1/enroll/challenge", json={"token": token})
    assert challenge.status_code == 200, challenge.text
    nonce = challenge.json()["nonce"]
    public = X25519PrivateKey.generate().public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    quote = SimulatedTdx(enroll.pki(), image=enroll.DEV_IMAGE).quote(
        report_data(nonce, cvm_id, public)
    )
    time.sleep(pause)  # a real TD's quote takes a while; others may challenge meanwhile
    return client.post(
        "/api/v1/enroll",
        json={
            "token": token,
            "nonce": nonce,
            "quote": base64.b64encode(quote).decode(),
            "public_key": base64.b64encode(public).decode(),
        },
    )


def _race(calls: list[Callable[[], httpx.Response]]) -> list[httpx.Response]:
    barrier = threading.Barrier(len(calls))

    def go(call: Callable[[], httpx.Response]) -> httpx.Response:
        barrier.wait()
        return call()

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(go, calls))


def _token(team: Team, cvm_id: str) -> str:
    minted = team.admin.post(f"/api/v1/cvms/{cvm_id}/enrollment-token")
    assert minted.status_code == 201, minted.text
    return str(minted.json()["token"])


@pytest.mark.parametrize("server", ["postgresql"], indirect=True)
def test_parallel_enrollments_with_one_token_have_one_winner(team: Team) -> None:
    cvm_id = team.dev_cvm()
    token = _token(team, cvm_id)
    pool = [team.server.client() for _ in range(PARALLEL)]
    try:
        responses = _race([lambda c=c: _attempt(c, token, cvm_id) for c in pool])  # type: ignore[misc]
    finally:
        for client in pool:
            client.close()
    codes = sorted(r.status_code for r in responses)
    assert codes == [200] + [403] * (PARALLEL - 1), [r.text for r in responses]
    losers = [r.json()["detail"] for r in responses if r.status_code == 403]
    assert set(losers) == {"enrollment refused: reused_token"}, losers
    assert team.admin.get(f"/api/v1/cvms/{cvm_id}").json()["state"] == "running"


@pytest.mark.parametrize("server", ["postgresql"], indirect=True)
def test_a_client_polling_challenges_cannot_block_the_genuine_cvm(team: Team) -> None:
    stop = threading.Event()
    polls: list[int] = []

    def poll(token: str) -> None:
        with team.server.client() as copier:
            while not stop.is_set():
                polls.append(
                    copier.post("/api/v1/enroll/challenge", json={"token": token}).status_code
                )
                stop.wait(0.05)

    for _ in range(3):
        cvm_id = team.dev_cvm()
        token = _token(team, cvm_id)
        stop.clear()
        poller = threading.Thread(target=poll, args=(token,))
        poller.start()
        try:
            with team.server.client() as genuine:
                response = _attempt(genuine, token, cvm_id, pause=0.3)
        finally:
            stop.set()
            poller.join()
        assert response.status_code == 200, response.text
    assert len(polls) >= 10 and 200 in polls


def _refusals(team: Team) -> int:
    with team.server.console.session() as session:
        count: int = session.execute(
            select(func.count())
            .select_from(AuditEntry)
            .where(col(AuditEntry.action) == "cvm.enroll_refused")
            .where(col(AuditEntry.team) == "-")
        ).scalar_one()
    return count


@pytest.mark.parametrize("server", ["postgresql"], indirect=True)
def test_anonymous_refusals_are_audited_at_most_the_budget_per_minute(team: Team) -> None:
    budget = team.server.settings.enroll_refusals_per_minute
    before = _refusals(team)
    flood = 2 * budget + 20

    def anonymous(client: httpx.Client) -> list[int]:
        return [
            client.post(
                "/api/v1/enroll/challenge", json={"token": "umbra_enr_" + secrets.token_hex(16)}
            ).status_code
            for _ in range(flood // 4)
        ]

    pool = [team.server.client() for _ in range(4)]
    try:
        with ThreadPoolExecutor(4) as executor:
            codes = [code for batch in executor.map(anonymous, pool) for code in batch]
    finally:
        for client in pool:
            client.close()
    assert set(codes) == {403}
    # At most a budget per minute window (the flood may straddle one boundary).
    assert _refusals(team) - before <= 2 * budget


def test_nonce_is_bound_to_its_token_and_expires() -> None:
    key = secrets.token_bytes(32)
    now = utcnow()
    nonce = enrollment.make_nonce(key, "umbra_enr_a" * 2, now)
    assert len(nonce) == 64
    assert enrollment.nonce_valid(key, "umbra_enr_a" * 2, nonce, now)
    assert not enrollment.nonce_valid(key, "umbra_enr_b" * 2, nonce, now)
    assert not enrollment.nonce_valid(secrets.token_bytes(32), "umbra_enr_a" * 2, nonce, now)
    later = now + enrollment.NONCE_TTL + timedelta(seconds=2)
    assert not enrollment.nonce_valid(key, "umbra_enr_a" * 2, nonce, later)
    tampered = ("A" if nonce[0] != "A" else "B") + nonce[1:]
    assert not enrollment.nonce_valid(key, "umbra_enr_a" * 2, tampered, now)


def test_refusal_budget_summarizes_each_minute_past_the_limit() -> None:
    clock = [600.0]
    budget = RefusalBudget(3, clock=lambda: clock[0])
    admitted = [budget.admit("-", "unknown_token") for _ in range(5)]
    assert [a for a, _ in admitted] == [True, True, True, False, False]
    assert budget.admit("team-a", "expired_token")[0]  # each team key has its own budget
    clock[0] += 60
    again, summaries = budget.admit("-", "unknown_token")
    assert again
    assert [(s.team, s.reasons) for s in summaries] == [("-", {"unknown_token": 2})]
    assert summaries[0].details()["refused"] == 2
    for _ in range(4):
        budget.admit("-", "reused_token")
    assert budget.drain() == []  # the current minute is still open
    final = budget.drain(final=True)
    assert [(s.team, s.reasons) for s in final] == [("-", {"reused_token": 2})]


@pytest.mark.parametrize("server", ["postgresql"], indirect=True)
def test_refusals_past_the_budget_become_one_summary_entry(team: Team) -> None:
    console = team.server.console
    saved, console.refusals = console.refusals, RefusalBudget(2)
    try:
        with team.server.client() as anonymous:
            for _ in range(5):
                token = "umbra_enr_" + secrets.token_hex(16)
                refused = anonymous.post("/api/v1/enroll/challenge", json={"token": token})
                assert refused.status_code == 403
        assert refusal_budget.flush(console, final=True) == 1
    finally:
        console.refusals = saved
    with console.session() as session:
        summary = session.execute(
            select(AuditEntry)
            .where(col(AuditEntry.action) == "cvm.enroll_refused_summary")
            .order_by(col(AuditEntry.seq).desc())
            .limit(1)
        ).scalar_one()
    assert (summary.team, summary.target) == ("-", "-")
    assert summary.details["refused"] == 3
    assert summary.details["reasons"] == {"unknown_token": 3}
