"""The login shells a developer starts inside a running session, each after its own way of
clearing the environment: `sudo -i` and `su -` (PAM; `su` through sudo, since the user has no
password) and a new `bash -l`, as every session starts. Shared by `umbra up`'s and the cloud dev
host's tests of the sandbox environment."""

from __future__ import annotations

from umbra.sandbox import local_cvm

LOGIN_SHELLS = {
    "sudo -i": "sudo -n -i printenv {name}",
    "su - dev": "sudo -n su - dev -c 'printenv {name}'",
    "su - (root)": "sudo -n su - -c 'printenv {name}'",
    "bash -l": "env -i HOME=/home/dev bash -lc 'printenv {name}'",
}


def login_shells_see(plan: local_cvm.LocalCvmPlan, name: str) -> dict[str, str]:
    """`name` in each kind of login shell ("unset" when it has none)."""
    seen = {}
    for kind, command in LOGIN_SHELLS.items():
        done = local_cvm.run_in_sandbox(plan, ["bash", "-c", command.format(name=name)])
        seen[kind] = done.stdout.strip() if done.returncode == 0 else "unset"
    return seen


def pam_env_assignments(plan: local_cvm.LocalCvmPlan) -> str:
    """How many assignments /etc/environment (pam_env's file) holds in the sandbox."""
    done = local_cvm.run_in_sandbox(plan, ["grep", "-c", "=", "/etc/environment"])
    return done.stdout.strip()
