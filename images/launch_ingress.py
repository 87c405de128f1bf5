"""A cloud Dev CVM's attested SSH ingress, started by the launch agent after the compose is up.

The ingress (`umbra sandbox ingress`, docs/specs/session.md) is a **host** process: it runs a
gateway `sshd -i` per attested connection as host root, in the sandbox's network namespace, and
its sessions enter the sandbox with nsenter. No compose service may do that (the validator
refuses shared pid/network namespaces), so it is a systemd unit, `umbra-ingress.service`
(images/os/), that only this agent starts, once the config it needs exists:
- its configuration is launch-time state (the sandbox container's PID, the quote source), which
  only exists after the compose is up;
- systemd supervises it (restart on failure, journal), outside the agent's oneshot unit;
- it is not enabled at boot: without the agent's config it has nothing to serve
  (`ConditionPathExists`), and a refused launch therefore opens no SSH port.

What the agent writes (root-only, /run/umbra/ingress, 0700): `config.json` (validated by
`IngressConfig` before it is written). On a Dev CVM its `sandbox.pid_file` is runc's own pid
file of the dev host's sandbox (sandbox/dev_host.py), read per connection: after the supervisor
restarts the sandbox, sessions enter the new process, never a stale PID. (Another locator's pid
is written by the agent to `sandbox.pid`.) The host key is the agent's (`host_key_file`, measured as
`umbra.ssh-host-key`); the quote source is the TD's configfs with the agent's event log.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pydantic import ValidationError

from umbra.components.ports import DEV_ATTESTED_SSH_PORT
from umbra.contracts.files import write_atomic
from umbra.sandbox.ingress_config import IngressConfig
from umbra.sandbox.local_cvm import SANDBOX_SESSIONS
from umbra.sandbox.render import canonical_json
from umbra.sandbox.sandbox_locator import (
    PidFileSandbox,
    SandboxLocateError,
    SandboxLocator,
)

__all__ = [
    "PidFileSandbox",
    "SandboxLocator",
]  # where the agent's callers import them from

INGRESS_DIR = Path("/run/umbra/ingress")  # root 0700: config.json, sandbox.pid
INGRESS_STATE = Path("/var/lib/umbra/ingress")  # root 0700, the ingress's own (host key copy…)
INGRESS_UNIT = "umbra-ingress.service"
CONFIG_NAME = "config.json"
PID_NAME = "sandbox.pid"
SANDBOX_UID = 1000  # the sandbox image's user (sandbox/image.py)
# The unit's TimeoutStartSec (images/os/umbra-ingress.service, a test holds them equal): systemd
# fails a start that slow; `systemctl start` is given a minute more, so systemd says why first.
START_TIMEOUT = 900
SESSIONS_DIR = SANDBOX_SESSIONS  # the dtach sockets, inside the sandbox


class IngressStartError(Exception):
    """The ingress cannot be configured or started; the message says what and why."""


class IngressStarter(Protocol):
    def start(self) -> None: ...


@dataclass(frozen=True)
class SystemdUnit:
    unit: str = INGRESS_UNIT

    def start(self) -> None:
        try:
            done = subprocess.run(
                ["systemctl", "start", self.unit],
                capture_output=True,
                text=True,
                check=False,
                # The unit is Type=notify: this waits until the ingress listens.
                timeout=START_TIMEOUT + 60,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise IngressStartError(f"systemctl start {self.unit}: {exc}") from None
        if done.returncode != 0:
            raise IngressStartError(f"systemctl start {self.unit}: {done.stderr.strip()}")


def ingress_config(
    launch_dir: Path,
    pid_file: Path,
    quote_source: dict[str, str],
    user: str,
    state_dir: Path = INGRESS_STATE,
    port: int = DEV_ATTESTED_SSH_PORT,
) -> dict[str, Any]:
    """The ingress's configuration as the agent writes it (a plain document: JSON on disk)."""
    ssh = launch_dir / "ssh"
    doc: dict[str, Any] = {
        # Every host address: the host firewall admits this port from outside only (never from
        # the compose's internal networks: components.host_firewall).
        "listen": {"host": "0.0.0.0", "port": port},  # noqa: S104
        "launch_dir": str(ssh),  # authorized_keys, cvm-id: measured launch data
        "state_dir": str(state_dir),
        "host_key_file": str(ssh / "ssh_host_ed25519_key"),  # the agent's: umbra.ssh-host-key
        "sandbox": {
            "pid_file": str(pid_file),
            "uid": SANDBOX_UID,
            "gid": SANDBOX_UID,
            "user": user,
            "home": f"/home/{user}",
            "sessions_dir": SESSIONS_DIR,
        },
        "quote_source": quote_source,
    }
    return doc


@dataclass(frozen=True)
class AttestedIngress:
    """What the agent does for SSH once the Dev compose is up: find the sandbox, write the
    ingress's config, start its unit. `quote_source` is `{kind: configfs}` on TDX (the agent's
    event log is added here); tests give a simulated one."""

    locator: SandboxLocator
    starter: IngressStarter
    quote_source: dict[str, str]
    config_dir: Path = INGRESS_DIR
    state_dir: Path = INGRESS_STATE
    port: int = DEV_ATTESTED_SSH_PORT

    def start(self, launch_dir: Path, user: str) -> IngressConfig:
        try:
            pid = self.locator.pid()
        except SandboxLocateError as exc:
            raise IngressStartError(str(exc)) from None
        self.config_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.config_dir, 0o700)
        # The dev host's sandbox: runc's own pid file, never a copy that could go stale.
        own = isinstance(self.locator, PidFileSandbox)
        pid_file = (
            self.locator.path
            if isinstance(self.locator, PidFileSandbox)
            else (self.config_dir / PID_NAME)
        )
        source = {"event_log": str(launch_dir / "event-log.json"), **self.quote_source}
        doc = ingress_config(launch_dir, pid_file, source, user, self.state_dir, self.port)
        try:
            config = IngressConfig.model_validate(doc)
        except ValidationError as exc:
            raise IngressStartError(f"ingress config: {exc}") from None
        if not own:
            write_atomic(pid_file, f"{pid}\n", 0o600)
        write_atomic(self.config_dir / CONFIG_NAME, canonical_json(doc) + "\n", 0o600)
        self.starter.start()
        return config
