"""The SSH key a Dev CVM is launched with when `umbra cvm launch` is given none.

ssh's own default public keys (`~/.ssh/id_ed25519.pub`, `id_ecdsa.pub`, `id_rsa.pub`) first; with
none, an ed25519 key made once by `ssh-keygen` under umbra's config dir (`ssh/id_ed25519`, 0600,
no passphrase: it opens only Dev CVMs, whose host keys are pinned from attested quotes), which
`umbra ssh` and `umbra config-ssh` then offer (`ssh_config.options`). No typer/rich: the session
options import this."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from umbra.cli.credentials import private_dir, ssh_dir

SSH_DEFAULTS = ("id_ed25519", "id_ecdsa", "id_rsa")


class SshKeyError(Exception):
    """No key could be found or made; the message says what to do."""


def generated_key() -> Path:
    return ssh_dir() / "id_ed25519"


def default_public_key() -> tuple[Path, bool]:
    """(public key file, created now)."""
    for name in SSH_DEFAULTS:
        pub = Path.home() / ".ssh" / f"{name}.pub"
        if pub.is_file():
            return pub, False
    key = generated_key()
    pub = key.with_name(key.name + ".pub")
    if key.is_file() and pub.is_file():
        return pub, False
    keygen = shutil.which("ssh-keygen")
    if keygen is None:
        raise SshKeyError("no SSH key given or found and ssh-keygen is missing: pass --ssh-key")
    private_dir(key.parent)
    for stale in (key, pub):  # a half-made pair from an interrupted run
        stale.unlink(missing_ok=True)
    done = subprocess.run(
        [keygen, "-q", "-t", "ed25519", "-N", "", "-C", "umbra", "-f", str(key)],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    if done.returncode != 0:
        raise SshKeyError(f"ssh-keygen failed: {done.stderr.strip()[:200]}")
    os.chmod(key, 0o600)
    return pub, True
