"""The sandbox under cgroup v2, run for real on this hybrid-v1 machine.

A CVM's trixie kernel runs cgroup v2; this machine is hybrid (v1 hierarchies for most
controllers, an unified v2 hierarchy holding the rest: here `hugetlb`). The probe
(tests/sandbox/cgroup2_probe.py) runs in a private mount namespace whose /sys/fs/cgroup is that
v2 hierarchy, so runc, the runtime's delegation (sandbox/runtime.py) and the sandbox's init
(images/sandbox/umbra-sandbox-init) all take their v2 paths, on the real kernel. What a v2-only
kernel adds is more controllers in the same files; the delegation rules are the same.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from umbra.sandbox import image

ROOT = Path(__file__).resolve().parents[2]


def _require() -> None:
    if os.geteuid() != 0:
        pytest.skip("the sandbox runtime needs root (CI runs as root)")
    for tool in ("runc", "mmdebstrap", "npm", "ip", "nft", "nsenter", "unshare"):
        if shutil.which(tool) is None:
            pytest.skip(f"missing {tool}: scripts/system-deps installs it")
    if "cgroup2" not in Path("/proc/filesystems").read_text():
        pytest.skip("this kernel has no cgroup2 file system")


def test_v2_delegation_gives_nested_docker_its_cgroups(tmp_path: Path) -> None:
    _require()
    image.ensure_image()  # cached once per machine; the probe must not build under its timeout
    script = (
        "set -e; mount -t cgroup2 cgroup2 /sys/fs/cgroup;"
        f' exec "{sys.executable}" -m tests.sandbox.cgroup2_probe "$0" "$1"'
    )
    prefix = f"ucg{os.getpid() % 100000}"
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script,
         str(tmp_path / "cvms"), prefix],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["cgroup_v2"] is True
    assert "dockerd_log" not in found, found["dockerd_log"]
    # The runtime delegated the sandbox's cgroup to its root (an unprivileged host uid)...
    assert found["base_owner"] == found["sandbox_uid"]
    # ...whose init moved every process of its own into a leaf and enabled every controller it
    # was given for its children: the "no internal processes" rule leaves no other way.
    assert found["base_procs"] == [] and found["init_procs"] >= 2, found
    assert found["subtree_control"] == found["host_controllers"], found
    # (The kernel still lists its v1 hierarchies in /proc/PID/cgroup; "0::" is the v2 line.)
    assert "0::/init" in found["inside_cgroup"].splitlines(), found
    # Nested Docker builds and runs an image, its container in a cgroup of its own under the
    # sandbox's (made by the sandbox's root), with the delegated controllers.
    assert found["build"][0] == 0, found["build"]
    assert found["run"][0] == 0, found["run"]
    assert found["run"][1].endswith("built"), found["run"]
    nested = [c for c in found["nested_cgroups"] if c["path"].startswith("docker/")]
    assert nested, found["nested_cgroups"]
    for cgroup in nested:
        assert cgroup["owner"] == found["sandbox_uid"], cgroup
        assert set(found["host_controllers"]) <= set(cgroup["controllers"]), cgroup
