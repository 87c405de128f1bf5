"""The OpenSSH options every Umbra session uses, as argv (`umbra ssh`) or as a `Host` block in
~/.ssh/config (`umbra config-ssh`): one definition for both."""

from __future__ import annotations

import difflib
import os
import shlex
import stat
import sys
import tempfile
from pathlib import Path

from umbra.cli.credentials import embedded_client, host_alias, known_hosts_path
from umbra.cli.ssh_key import SSH_DEFAULTS, generated_key
from umbra.contracts.files import write_atomic

BEGIN = "# >>> umbra config-ssh: managed block, replaced by `umbra config-ssh` >>>"
END = "# <<< umbra config-ssh <<<"
CONTROL_PERSIST = "10m"
IDENTITY_ENV = "UMBRA_SSH_IDENTITY"  # which key ssh offers (default: ssh's own choice)


class SshConfigError(Exception):
    pass


def control_dir() -> Path:
    """Short (Unix socket paths are ≤ 108 bytes), private, ours."""
    path = Path(os.environ.get("TMPDIR") or tempfile.gettempdir()) / f"umbra-ssh-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise SshConfigError(f"{path} must be a directory owned by you with mode 0700")
    return path


FAST_PROXY = Path(__file__).with_name("ssh_fastproxy.py")


def proxy_command(cvm_id: str) -> str:
    """The fast ProxyCommand (warm agent, fd passing); `umbra ssh-proxy` is the same checks in
    one process (`python -m umbra.cli.ssh_proxy`)."""
    return shlex.join([sys.executable, "-S", "-I", str(FAST_PROXY), cvm_id])


def options(cvm_id: str, *, reuse: bool = True) -> list[tuple[str, str]]:
    # Here, not at the top: the session contract pulls in attestation (cryptography, dcap-qvl),
    # which `umbra ssh --help` does not need.
    from umbra.contracts.session import LOGIN_USER

    opts = [
        ("User", LOGIN_USER),
        ("ProxyCommand", proxy_command(cvm_id)),
        ("ProxyUseFdpass", "yes"),
        ("HostKeyAlias", host_alias(cvm_id)),
        ("UserKnownHostsFile", str(known_hosts_path())),
        ("GlobalKnownHostsFile", "/dev/null"),
        ("StrictHostKeyChecking", "yes"),
        ("UpdateHostKeys", "no"),
        ("ForwardAgent", "no"),
        ("ForwardX11", "no"),
        ("ClearAllForwardings", "no"),
    ]
    identity = os.environ.get(IDENTITY_ENV)
    if not identity:
        local = embedded_client()  # the key `umbra up` gave its Dev CVM
        identity = local.ssh_identity if local is not None else None
    if identity:
        opts += [("IdentityFile", identity), ("IdentitiesOnly", "yes")]
    elif generated_key().is_file():
        # Made by `umbra cvm launch`. Naming one IdentityFile drops ssh's defaults: name those
        # that exist too, so keys made later in ~/.ssh keep working.
        defaults = [Path.home() / ".ssh" / name for name in SSH_DEFAULTS]
        opts += [
            ("IdentityFile", str(path)) for path in (generated_key(), *defaults) if path.is_file()
        ]
    if reuse:
        opts += [
            ("ControlMaster", "auto"),
            ("ControlPath", str(control_dir() / "%C")),
            ("ControlPersist", CONTROL_PERSIST),
        ]
    else:
        opts += [("ControlMaster", "no"), ("ControlPath", "none")]
    return opts


def ssh_argv(cvm_id: str, *, reuse: bool = True, extra: list[str] | None = None) -> list[str]:
    argv = ["ssh"]
    for key, value in options(cvm_id, reuse=reuse):
        argv += ["-o", f"{key}={value}"]
    return [*argv, *(extra or []), host_alias(cvm_id)]


def host_block(name: str, cvm_id: str) -> str:
    lines = [f"Host umbra-{name}", f"    HostName {host_alias(cvm_id)}"]
    lines += [f"    {key} {value}" for key, value in options(cvm_id)]
    return "\n".join(lines)


def render(current: str, hosts: list[tuple[str, str]]) -> str:
    """`current` with the managed block replaced (or appended); everything else untouched."""
    lines = current.splitlines()
    if BEGIN in lines:
        if END not in lines[lines.index(BEGIN) :]:
            raise SshConfigError(f"the managed block starts but never ends ({END!r} missing)")
        start = lines.index(BEGIN)
        stop = lines.index(END, start)
        before, after = lines[:start], lines[stop + 1 :]
    else:
        before, after = lines, []
        while before and not before[-1].strip():
            before.pop()
        if before:
            before.append("")
    block = [BEGIN, *(host_block(n, i) for n, i in sorted(hosts)), END] if hosts else []
    out = "\n".join([*before, *block, *after]).rstrip("\n")
    return out + "\n" if out else ""


def diff(old: str, new: str, path: Path) -> str:
    return "".join(
        difflib.unified_diff(
            old.splitlines(keepends=True), new.splitlines(keepends=True), str(path), str(path)
        )
    )


def replace_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    mode = stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o600
    write_atomic(path, text, mode, sync=True)
