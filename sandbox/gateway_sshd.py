"""The gateway sshd behind the attested ingress: host-side files and the per-connection argv.

One `sshd -i` per attested connection, run as host root from a root-only state directory the
sandbox cannot see: host key (generated here, never leaves the CVM), `sshd_config`, the copy of
the launch-bound `authorized_keys`, and the `enter` script that is sshd's ForceCommand. sshd sits
in the sandbox's network namespace (so `-L` reaches sandbox ports); every session channel (shell,
exec, sftp) runs through `enter`, which joins the sandbox as its user. Nothing inside the sandbox
can change who logs in: keys are read from the state directory, never from a home directory.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm

from umbra.attest.measurement import canonical_ssh_key
from umbra.contracts.files import write_atomic
from umbra.contracts.session import LOGIN_USER
from umbra.sandbox.ingress_config import IngressConfig, IngressConfigError

HOST_KEY = "ssh_host_ed25519_key"
CVM_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
PRIVSEP_DIR = Path("/run/sshd")


@dataclass(frozen=True)
class LaunchData:
    cvm_id: str
    authorized_keys: tuple[str, ...]  # canonical `type base64` lines


def read_launch(launch_dir: Path) -> LaunchData:
    try:
        cvm_id = (launch_dir / "cvm-id").read_text().strip()
        lines = (launch_dir / "authorized_keys").read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise IngressConfigError(f"{launch_dir}: cannot read launch data: {exc}") from None
    if not CVM_ID.match(cvm_id):
        raise IngressConfigError(f"{launch_dir}/cvm-id: {cvm_id[:40]!r} is not a CVM id")
    keys: list[str] = []
    for number, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            keys.append(canonical_ssh_key(line))
        except ValueError as exc:
            raise IngressConfigError(f"{launch_dir}/authorized_keys:{number}: {exc}") from None
    if not keys:
        raise IngressConfigError(f"{launch_dir}/authorized_keys: no key: nobody could log in")
    return LaunchData(cvm_id, tuple(sorted(set(keys))))


def secure_state_dir(path: Path) -> None:
    """Create or check the state directory: a real directory, owned by us, mode 0700."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise IngressConfigError(
            f"{path}: state_dir must be a directory owned by uid {os.geteuid()}"
        )
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)


def ensure_host_key(state_dir: Path) -> str:
    """The CVM's SSH host key, generated on first start; returns its public line."""
    key = state_dir / HOST_KEY
    if not key.exists():
        done = subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "umbra-ingress", "-f", str(key)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise IngressConfigError(f"ssh-keygen failed: {done.stderr.strip()}")
    try:
        return canonical_ssh_key(key.with_suffix(".pub").read_text())
    except (OSError, ValueError) as exc:
        raise IngressConfigError(f"{key}.pub: {exc}") from None


def adopt_host_key(state_dir: Path, source: Path) -> None:
    """Make `source` (the launch agent's key, root 0600) the state directory's host key: its
    private bytes copied as they are (checked to be an OpenSSH key), its public line derived."""
    from cryptography.hazmat.primitives import serialization

    try:
        data = source.read_bytes()
        private = serialization.load_ssh_private_key(data, password=None)
    except OSError as exc:
        raise IngressConfigError(f"{source}: cannot read the host key: {exc.strerror}") from None
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise IngressConfigError(f"{source}: not an OpenSSH private key: {exc}") from None
    public = private.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    key = state_dir / HOST_KEY
    write_atomic(key, data.decode(), 0o600)
    write_atomic(key.with_suffix(".pub"), canonical_ssh_key(public.decode()) + "\n", 0o644)


BOUND_KEYS = "bound-host-keys"


def bound_key_path(state_dir: Path, public_line: str) -> Path:
    """Where the ingress keeps the exact private key it bound for `public_line`."""
    digest = hashlib.sha256(public_line.encode()).hexdigest()
    return state_dir / BOUND_KEYS / digest


def snapshot_host_key(state_dir: Path) -> str:
    """Read the host key file once, keep those bytes where only we write (content-addressed by
    the public key), and return the public line: what this connection's quote binds and the
    exact key its sshd gets (`-h`), so a swapped file cannot slip in between."""
    from cryptography.hazmat.primitives import serialization

    data = (state_dir / HOST_KEY).read_bytes()
    try:
        private = serialization.load_ssh_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise ValueError(f"{state_dir / HOST_KEY} is not an OpenSSH private key: {exc}") from None
    public = private.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    line = canonical_ssh_key(public.decode())
    path = bound_key_path(state_dir, line)
    if not path.exists():  # concurrent first connections: unique temp names, atomic rename
        path.parent.mkdir(mode=0o700, exist_ok=True)
        write_atomic(path, data, 0o600)
    return line


def sandbox_pid(config: IngressConfig) -> int | None:
    entry = config.sandbox
    if entry.pid is not None:
        return entry.pid
    if entry.pid_file is None:
        return None
    try:
        return int(entry.pid_file.read_text().strip())
    except (OSError, ValueError) as exc:
        raise IngressConfigError(f"{entry.pid_file}: no sandbox pid: {exc}") from None


def netns_path(config: IngressConfig) -> str:
    """The sandbox's network namespace, where sshd runs. A PID (read per connection) whose
    process shares our network namespace is not a sandbox: a stale PID file whose number a host
    process reused, e.g. after the sandbox container restarted. Refused, never entered."""
    if config.sandbox.netns is not None:
        return f"/run/netns/{config.sandbox.netns}"
    path = f"/proc/{sandbox_pid(config)}/ns/net"
    try:
        theirs, ours = os.stat(path), os.stat("/proc/self/ns/net")
    except OSError as exc:
        raise IngressConfigError(f"{path}: the sandbox process is gone: {exc.strerror}") from None
    if (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino):
        raise IngressConfigError(
            f"{path}: that process is in the host's network namespace, not a sandbox "
            "(stale PID file?)"
        )
    return path


def enter_script(config: IngressConfig) -> str:
    entry = config.sandbox
    env = (
        f"HOME={entry.home} USER={entry.user} LOGNAME={entry.user} SHELL={entry.shell} "
        f"PATH={entry.path} UMBRA_SESSIONS={entry.sessions_dir} LANG=C.UTF-8"
    )
    find = ""
    if entry.pid is not None or entry.pid_file is not None:
        target = str(entry.pid) if entry.pid is not None else f"$(cat {entry.pid_file})"
        # A sandbox without a user namespace of its own (runc: development and CI only) cannot
        # be "joined" into the one we are in (setns fails); it then keeps ours, as runc gave it.
        find = (
            f'pid="{target}"; userns=--user\n'
            '[ "$(readlink /proc/"$pid"/ns/user)" != "$(readlink /proc/self/ns/user)" ]'
            " || userns=\n"
        )
        # --root: the sandbox process's root (a chrooted sandbox's tree, not the host's view of
        # its mount namespace); --wdns: the home directory as seen from inside it.
        join = (
            '/usr/bin/nsenter --target "$pid" $userns --mount --pid --net --uts --ipc '
            f"--root --setuid {entry.uid} --setgid {entry.gid} --wdns={entry.home} --"
        )
    else:
        join = (
            f"/usr/bin/nsenter --net=/run/netns/{entry.netns} -- /usr/bin/setpriv "
            f"--reuid {entry.uid} --regid {entry.gid} --clear-groups --no-new-privs --"
        )
    return f"""#!/bin/sh
# Written by `umbra sandbox ingress`: sshd's ForceCommand. Runs the session in the sandbox as
# its user: an interactive login shell, or the requested command (exec, sftp) via a login shell,
# so every session has the environment the sandbox defines (/etc/profile, profile.d); the
# configured PATH is appended to the login one, never in front of the user's ~/.local/bin.
set -eu
{find}if [ -z "${{SSH_ORIGINAL_COMMAND:-}}" ]; then set -- {entry.shell} -l
else set -- {entry.shell} -lc 'PATH="$PATH:{entry.path}"; export PATH; eval "$1"' \
  umbra-session "$SSH_ORIGINAL_COMMAND"; fi
exec /usr/bin/env -i {env} TERM="${{TERM:-dumb}}" SSH_CONNECTION="${{SSH_CONNECTION:-}}" \\
  {join} "$@"
"""


def sshd_config(config: IngressConfig) -> str:
    state = config.state_dir
    return f"""# Written by `umbra sandbox ingress`; regenerated at every start. No HostKey: each sshd
# gets, with -h, the exact key its connection's quote bound.
AuthorizedKeysFile {state / "authorized_keys"}
AuthorizedKeysCommand none
AuthorizedPrincipalsFile none
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
HostbasedAuthentication no
PermitRootLogin prohibit-password
AllowUsers {LOGIN_USER}
UsePAM no
# The ingress checks {state} itself (root, 0700): StrictModes would also walk its parents.
StrictModes no
AllowAgentForwarding no
AllowStreamLocalForwarding no
AllowTcpForwarding local
GatewayPorts no
PermitTunnel no
X11Forwarding no
PermitUserEnvironment no
PermitUserRC no
PrintMotd no
PrintLastLog no
PidFile none
LogLevel INFO
LoginGraceTime 30
MaxAuthTries 3
ClientAliveInterval 30
Subsystem sftp {config.sftp_server}
ForceCommand {state / "enter"}
"""


def prepare(config: IngressConfig, launch: LaunchData) -> str:
    """Write the gateway's files; return the host public key line."""
    secure_state_dir(config.state_dir)
    if config.host_key_file is not None:
        adopt_host_key(config.state_dir, config.host_key_file)
    host_key = ensure_host_key(config.state_dir)
    write_atomic(
        config.state_dir / "authorized_keys", "\n".join(launch.authorized_keys) + "\n", 0o600
    )
    write_atomic(config.state_dir / "enter", enter_script(config), 0o700)
    write_atomic(config.state_dir / "sshd_config", sshd_config(config), 0o600)
    PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
    done = subprocess.run(
        [
            str(config.sshd),
            "-t",
            "-f",
            str(config.state_dir / "sshd_config"),
            "-h",
            str(config.state_dir / HOST_KEY),
        ],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise IngressConfigError(f"sshd refuses the generated config: {done.stderr.strip()}")
    return host_key


def sshd_argv(config: IngressConfig, host_key_file: Path) -> list[str]:
    """One inetd-mode sshd in the sandbox's network namespace (still host root, host mounts),
    serving exactly `host_key_file` (the key its connection's quote bound)."""
    return [
        "/usr/bin/nsenter",
        f"--net={netns_path(config)}",
        "--",
        str(config.sshd),
        "-i",
        "-e",
        "-f",
        str(config.state_dir / "sshd_config"),
        "-h",
        str(host_key_file),
    ]
