"""Where the cloud sandbox's process is now: runc's pid file of the Dev CVM's sandbox
(sandbox/dev_host.py).

The attested ingress enters the sandbox through a process's namespaces. A restart (the dev
host's supervisor) gives the sandbox a new process, so a PID written once at launch goes stale;
the ingress reads runc's pid file again for every connection (gateway_sshd.sandbox_pid) and the
launch agent asks this locator once to configure the ingress.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


class SandboxLocateError(Exception):
    """The sandbox's process cannot be found; the message says what and why."""


class SandboxLocator(Protocol):
    def pid(self) -> int: ...


@dataclass(frozen=True)
class PidFileSandbox:
    """The dev host's sandbox: runc rewrites `path` whenever the supervisor restarts it, so the
    ingress reads it per connection and never enters a stale process."""

    path: Path

    def pid(self) -> int:
        try:
            text = self.path.read_text().strip()
        except OSError as exc:
            raise SandboxLocateError(f"{self.path}: no sandbox pid: {exc.strerror}") from None
        if not text.isdigit() or int(text) < 2 or not Path(f"/proc/{text}").exists():
            raise SandboxLocateError(f"{self.path}: the sandbox is not running (pid {text!r})")
        return int(text)
