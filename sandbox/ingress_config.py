"""The Dev CVM's attested SSH ingress: its configuration (`umbra sandbox ingress --config FILE`).

JSON or YAML, strict (`extra="forbid"`); errors name the file, the field and the reason.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import Field, ValidationError, model_validator

from umbra.attest.quote_source import QuoteSourceKind
from umbra.contracts.model import Strict as _Strict
from umbra.contracts.validation import lines


class IngressConfigError(Exception):
    """The configuration or a launch file cannot be used; the message says which and why."""


class Listen(_Strict):
    host: str = Field(min_length=1)
    port: int = Field(ge=1, le=65535)


class SandboxEntry(_Strict):
    """How a session enters the sandbox.

    `pid`/`pid_file`: a process in the sandbox; sessions join all its namespaces (user, mount,
    pid, network, uts, ipc). `netns` only: sessions join that network namespace (under
    /run/netns) and drop to `uid`/`gid` on the host. sshd itself always sits in the sandbox's
    network namespace so that `-L` forwards reach ports inside it. A `pid_file` is read per
    connection (runc rewrites it when the sandbox restarts), so a restarted sandbox is entered
    anew.
    """

    pid: int | None = Field(default=None, ge=2)
    pid_file: Path | None = None
    netns: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    uid: int = Field(default=1000, ge=1, le=2**31)
    gid: int = Field(default=1000, ge=1, le=2**31)
    user: str = Field(default="dev", pattern=r"^[a-z_][a-z0-9_-]{0,31}$")
    home: str = Field(default="/home/dev", pattern=r"^/[^\s'\"\\$`]*$")
    shell: str = Field(default="/bin/bash", pattern=r"^/[^\s'\"\\$`]*$")
    path: str = Field(
        default="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        pattern=r"^/[^\s'\"\\$`]*$",
    )
    sessions_dir: str = Field(default="/run/umbra/sessions", pattern=r"^/[^\s'\"\\$`]*$")

    @model_validator(mode="after")
    def _one_target(self) -> SandboxEntry:
        if self.pid is not None and self.pid_file is not None:
            raise ValueError("give pid or pid_file, not both")
        if self.pid is None and self.pid_file is None and self.netns is None:
            raise ValueError("give pid, pid_file or netns: where the sandbox is")
        return self


class QuoteSourceConfig(_Strict):
    """`configfs`: the TD's configfs-tsm; the launch agent has already extended the host-key
    event, and `event_log` (served as is) must show it. `emulated`: the same, with the quotes of
    the emulated clouds' TDX module (attest.tdx_port) instead of configfs-tsm. `simulated`: the
    embedded default; the ingress extends the events itself into a simulated TD signed by
    `simulated_pki`."""

    kind: QuoteSourceKind
    event_log: Path | None = None
    simulated_pki: Path | None = None
    simulated_image: str = "umbra-dev-cvm"

    @model_validator(mode="after")
    def _pki(self) -> QuoteSourceConfig:
        if (self.kind is QuoteSourceKind.simulated) != (self.simulated_pki is not None):
            raise ValueError("simulated_pki is required with kind simulated, and only then")
        return self


class IngressConfig(_Strict):
    listen: Listen
    # Launch-bound, measured: `authorized_keys` and `cvm-id` (read-only to everyone but root).
    launch_dir: Path
    # Host-only, root 0700: host keys (generated here at first start), sshd_config, the copy of
    # authorized_keys sshd reads. The sandbox never sees this path.
    state_dir: Path
    sandbox: SandboxEntry
    quote_source: QuoteSourceConfig
    # A host key generated inside the TD by the launch agent (its `umbra.ssh-host-key` event
    # binds it): copied into state_dir at each start instead of generating one. A cloud Dev
    # CVM's /run/umbra/launch/ssh/ssh_host_ed25519_key.
    host_key_file: Path | None = None
    sshd: Path = Path("/usr/sbin/sshd")
    sftp_server: Path = Path("/usr/lib/openssh/sftp-server")
    handshake_timeout: float = Field(default=15.0, gt=0, le=300)
    max_connections: int = Field(default=32, ge=1, le=4096)


def load_ingress_config(path: Path) -> IngressConfig:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise IngressConfigError(f"{path}: cannot read: {exc}") from None
    try:
        doc = yaml.safe_load(text)  # JSON is YAML
    except yaml.YAMLError as exc:
        raise IngressConfigError(f"{path}: not valid YAML/JSON: {exc}") from None
    try:
        return IngressConfig.model_validate(doc)
    except ValidationError as exc:
        msgs = [f"{path}: {line}" for line in lines(exc, "(top level)")]
        raise IngressConfigError("\n".join(msgs)) from None
