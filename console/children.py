"""Ending the provider's child processes (the `pulumi` CLI and its plugins) at shutdown.

Provider runs execute in worker threads that spawn child processes; when the Console stops, those
must not outlive it (an orphaned `pulumi up` keeps changing the cloud with no one to record the
outcome). Children are found through /proc, so nothing has to register them."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Field 4 is the parent pid; the command name (field 2) may contain spaces and ')'.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


def descendants(pid: int | None = None) -> list[int]:
    pending, found = [pid or os.getpid()], []
    while pending:
        for child in _children(pending.pop()):
            found.append(child)
            pending.append(child)
    return found


def terminate_descendants(grace: float = 2.0) -> int:
    """SIGTERM every descendant, SIGKILL whatever is left after `grace` seconds; return how many
    there were."""
    targets = descendants()
    for pid in targets:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(pid) for pid in targets):
        time.sleep(0.05)
    for pid in targets:
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return len(targets)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rfind(")") + 2 :].split()[0] != "Z"
