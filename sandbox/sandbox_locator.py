"""Where the cloud sandbox's process is now: runc's pid file of the Dev CVM's sandbox
(sandbox/dev_host.py), or a container found by docker-compose's labels.

The attested ingress enters the sandbox through a process's namespaces. A container restart
(`restart: unless-stopped`, a crash, an engine restart) gives the sandbox a new process, so a PID
written once at launch goes stale; the ingress asks this locator again for every connection
(gateway_sshd.sandbox_pid) and the launch agent asks it once to configure the ingress.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

COMPOSE_PROJECT = "umbra-dev"  # the rendered Dev compose's `name`
SANDBOX_SERVICE = "sandbox"


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


@dataclass(frozen=True)
class DockerSandbox:
    """The sandbox container of the running Dev compose, by docker-compose's labels."""

    project: str = COMPOSE_PROJECT
    service: str = SANDBOX_SERVICE
    docker: str = "docker"

    def _run(self, *args: str) -> str:
        try:
            done = subprocess.run(
                [self.docker, *args], capture_output=True, text=True, check=False, timeout=60
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SandboxLocateError(f"docker {args[0]}: {exc}") from None
        if done.returncode != 0:
            raise SandboxLocateError(f"docker {args[0]}: {done.stderr.strip()[-300:]}")
        return done.stdout

    def pid(self) -> int:
        ids = self._run(
            "ps",
            "--quiet",
            "--filter",
            f"label=com.docker.compose.project={self.project}",
            "--filter",
            f"label=com.docker.compose.service={self.service}",
        ).split()
        if len(ids) != 1:
            raise SandboxLocateError(
                f"want exactly one running {self.project}/{self.service} container, got {len(ids)}"
            )
        text = self._run("inspect", "--format", "{{.State.Pid}}", ids[0]).strip()
        if not text.isdigit() or int(text) < 2:
            # 0: not running. The ingress would enter whatever process holds that PID.
            raise SandboxLocateError(f"the sandbox container has no process (pid {text!r})")
        return int(text)
