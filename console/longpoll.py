"""Long polls: wait for a watched thing to change, woken by the in-process notifier
(`console.notifier`, signalled by writers after commit) or the periodic database recheck that
covers other Console replicas.

`watch` is the one shape every versioned document a Security CVM pulls has (bundle, attachments,
secrets version): load it, compare its ETag with `If-None-Match`, and while it is unchanged (or
there is nothing to serve yet) wait and load again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.concurrency import run_in_threadpool

from umbra.console.state import Console


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
            if (
                not unchanged(current)
                or remaining <= 0
                or console.notifier.stopping  # shutting down: answer what we hold now
                or (gone is not None and await gone())
            ):
                return current
            await console.notifier.wait(
                min(remaining, console.settings.long_poll_db_interval_seconds)
            )
    finally:
        console.metrics.long_polls.dec()


@dataclass(frozen=True)
class Watched[T]:
    """What a watch ended with: `value` None means there is nothing to serve yet (404)."""

    value: T | None
    etag: str | None
    unchanged: bool  # the caller already holds this version: answer 304 with the ETag

    @property
    def etag_header(self) -> dict[str, str]:
        return {"ETag": quoted(self.etag)} if self.etag is not None else {}


async def watch[T](
    console: Console,
    load: Callable[[], T | None],
    etag_of: Callable[[T], str],
    if_none_match: str | None,
    wait: int,
    gone: Callable[[], Awaitable[bool]] | None = None,
) -> Watched[T]:
    """Long poll one versioned document for up to `wait` seconds (capped by the settings). A load
    of None (nothing yet, e.g. no bundle uploaded) keeps waiting like an unchanged one."""
    known = parse_if_none_match(if_none_match)

    def unchanged(current: T | None) -> bool:
        return current is None or etag_of(current) in known

    seconds = float(min(wait, console.settings.long_poll_max_seconds))
    current = await long_poll(console, load, unchanged, seconds, gone)
    if current is None:
        return Watched(None, None, False)
    etag = etag_of(current)
    return Watched(current, etag, etag in known)
