"""The sandbox's environment file, kept current with the profiles attached to this CVM.

`sandbox.env` (KEY=VALUE lines, sourced by every login shell through /etc/profile.d/umbra.sh and
by `umbra-sandbox-init`) is this CVM's own values (the proxy, NO_PROXY, the CA variables) plus
the `sandbox_env` of its attached profiles. The forwarder asks the Security CVM for the latter
inside an attested session (tunnel header mode `env`) every few seconds and rewrites the file
atomically when it differs, so an attach or a detach reaches the next session within seconds.
The CVM's own values win over a profile's (the policy linter already refuses those names).
A failed fetch leaves the file as it is: the last attested environment stays, never a guess.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

from umbra.contracts.files import write_atomic

logger = logging.getLogger(__name__)


def render(base: Mapping[str, str], profile: Mapping[str, str]) -> str:
    """The file's text: the CVM's values, then the profiles' (sorted), each shell-quoted."""
    merged = dict(base)
    for name, value in sorted(profile.items()):
        merged.setdefault(name, value)
    return "".join(f"{name}={shlex.quote(value)}\n" for name, value in merged.items())


def write_if_changed(path: Path, text: str) -> bool:
    """Rewrite `path` (0644: the sandbox reads it through a read-only bind) when it differs."""
    try:
        if path.read_text() == text:
            return False
    except (OSError, UnicodeDecodeError):
        pass
    write_atomic(path, text.encode(), 0o644)
    return True


async def keep_env_fresh(
    fetch: Callable[[], Awaitable[dict[str, str] | None]],
    path: Path,
    base: Mapping[str, str],
    refresh: float,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    """Fetch every `refresh` seconds; rewrite the file when the attested environment changed
    (or someone rewrote the file: the sandbox's start renders the CVM's values alone)."""
    while True:
        env = await fetch()
        if env is not None:
            try:
                if write_if_changed(path, render(base, env)):
                    logger.warning("sandbox environment now has %d profile variable(s)", len(env))
            except OSError as exc:
                logger.warning("sandbox environment not written: %s", exc)
        await sleep(refresh)
