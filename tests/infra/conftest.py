"""Pulumi's mock runtime drives its program on `asyncio.get_event_loop()`; other suites (pytest-
asyncio) leave the main thread without a current loop, so each infra test gets a fresh one."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def current_event_loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield loop
    asyncio.set_event_loop(None)
    loop.close()
