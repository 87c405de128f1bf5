"""Helpers shared by route modules: team path parameter, CVM visibility, ETags and long polls."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import HTTPException, Path, status
from sqlalchemy import select
from sqlalchemy.orm import Session
from sqlmodel import col
from starlette.concurrency import run_in_threadpool

from umbra.console.deps import User
from umbra.console.models import Cvm, PolicyBundle
from umbra.console.schemas import CVM_ID_PATTERN, NAME_PATTERN, CvmInfo
from umbra.console.state import Console

TeamPath = Annotated[str, Path(pattern=NAME_PATTERN, description="Team name.")]
CvmIdPath = Annotated[str, Path(pattern=CVM_ID_PATTERN, description="CVM id.")]


def policy_lock(team: str) -> str:
    """Taken by bundle uploads and profile attachments: an attachment is checked against the
    bundle that is current when it commits, and an upload against the attachments."""
    return f"team:{team}:policy"


def cvm_lock(cvm_id: str) -> str:
    """Taken by every change to one CVM row (routes and provider outcomes)."""
    return f"cvm:{cvm_id}"


def not_found(what: str) -> HTTPException:
    return HTTPException(status.HTTP_404_NOT_FOUND, f"{what} not found")


def visible_cvm(session: Session, user: User, cvm_id: str) -> Cvm:
    """The CVM if the caller may see it: admins of its team, or the developer who owns it.

    Anyone else gets the same 404 as for a CVM that does not exist, so ids do not leak."""
    cvm = session.get(Cvm, cvm_id)
    if cvm is None:
        raise not_found(f"CVM {cvm_id}")
    role = user.role_in(cvm.team)
    if role == "admin" or (role == "developer" and cvm.owner == user.subject):
        return cvm
    raise not_found(f"CVM {cvm_id}")


def cvm_info(cvm: Cvm) -> CvmInfo:
    return CvmInfo.model_validate(cvm.model_dump(exclude={"credential_hash", "created_by"}))


def current_bundle(session: Session, team: str) -> PolicyBundle | None:
    return session.execute(
        select(PolicyBundle)
        .where(col(PolicyBundle.team) == team)
        .order_by(col(PolicyBundle.serial).desc())
        .limit(1)
    ).scalar_one_or_none()


def parse_if_none_match(header: str | None) -> set[str]:
    if not header:
        return set()
    tags = set()
    for part in header.split(","):
        tag = part.strip().removeprefix("W/").strip('"')
        if tag:
            tags.add(tag)
    return tags


def quoted(tag: str) -> str:
    return f'"{tag}"'


async def long_poll[T](
    console: Console,
    load: Callable[[], T],
    unchanged: Callable[[T], bool],
    wait: float,
    gone: Callable[[], Awaitable[bool]] | None = None,
) -> T:
    """Load now; while the result is `unchanged` and time remains, wait for a local change signal
    or the database recheck interval, then load again. Returns the last result. `gone` (the
    request's `is_disconnected`) ends the wait early when the caller has left, so a poll of a
    stopped Security CVM does not hold the Console's graceful shutdown for its whole wait."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    console.metrics.long_polls.inc()
    try:
        while True:
            current = await run_in_threadpool(load)
            remaining = deadline - loop.time()
            if not unchanged(current) or remaining <= 0 or (gone is not None and await gone()):
                return current
            await console.notifier.wait(
                min(remaining, console.settings.long_poll_db_interval_seconds)
            )
    finally:
        console.metrics.long_polls.dec()
