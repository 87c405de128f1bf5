"""Run by tests/sandbox/test_sandbox_cgroup2.py inside a private mount namespace whose
/sys/fs/cgroup is a cgroup2 mount (this machine's own unified hierarchy, which holds the
controllers no v1 hierarchy took): everything that must see cgroup v2 (runc, the runtime's
delegation, the sandbox's init and its nested dockerd) sees exactly what a CVM's v2 kernel shows.

    python -m tests.sandbox.cgroup2_probe DIR PREFIX   ->  one JSON line of findings on stdout

It starts one sandbox (no forwarder: the nested work needs no network), builds and runs a nested
image, reports what the cgroup tree looks like from the host, and removes everything it made.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from umbra.sandbox import image, local_cvm, runtime


def _sandbox(plan: local_cvm.LocalCvmPlan, script: str) -> subprocess.CompletedProcess[str]:
    return local_cvm.run_in_sandbox(plan, ["sh", "-c", script], "root", timeout=240)


def probe(root: Path, prefix: str) -> dict[str, Any]:
    found: dict[str, Any] = {"cgroup_v2": runtime.cgroup_v2()}
    found["host_controllers"] = (runtime.CGROUP_ROOT / "cgroup.controllers").read_text().split()
    plan = local_cvm.allocate(root, f"cvm_{os.urandom(6).hex()}", prefix)
    spec = local_cvm.sandbox_spec(plan, image.ensure_image(progress=lambda _line: None))
    base = runtime.CGROUP_ROOT / spec.cgroups_path.lstrip("/")
    try:
        local_cvm.create_network(plan, [local_cvm.SANDBOX_PROXY_PORT])
        local_cvm.start_sandbox(plan)
        end = time.monotonic() + 90
        while _sandbox(plan, "docker info >/dev/null 2>&1").returncode != 0:
            if time.monotonic() > end:
                found["dockerd_log"] = _sandbox(plan, "tail -30 /var/log/dockerd.log").stdout
                return found
            time.sleep(0.5)
        found["base_owner"] = base.stat().st_uid
        found["sandbox_uid"] = plan.uid
        found["base_procs"] = (base / "cgroup.procs").read_text().split()
        found["init_procs"] = len((base / "init" / "cgroup.procs").read_text().split())
        found["subtree_control"] = (base / "cgroup.subtree_control").read_text().split()
        found["inside_cgroup"] = _sandbox(plan, "cat /proc/1/cgroup").stdout.strip()
        built = _sandbox(
            plan,
            "set -e; mkdir -p /tmp/cg2 && cd /tmp/cg2 && cp /bin/busybox . &&"
            " printf 'FROM scratch\\nCOPY busybox /bin/busybox\\n"
            'RUN ["/bin/busybox", "sh", "-c", "/bin/busybox echo built > /hello"]\\n\' >'
            " Dockerfile && docker build -q --network none -t umbra-cg2 . >/dev/null",
        )
        found["build"] = [built.returncode, built.stderr[-600:]]
        ran = _sandbox(
            plan,
            "docker run -d --network none umbra-cg2 /bin/busybox sleep 60 &&"
            " sleep 1 && docker exec $(docker ps -q | head -1) /bin/busybox cat /proc/self/cgroup"
            " && docker exec $(docker ps -q | head -1) /bin/busybox cat /hello",
        )
        found["run"] = [ran.returncode, ran.stdout.strip(), ran.stderr[-600:]]
        # The nested container's cgroup, as the host sees it: under the sandbox's, made by the
        # sandbox's root, with the controllers the sandbox was given.
        nested = sorted(p.parent for p in base.rglob("cgroup.procs") if p.read_text().strip())
        found["nested_cgroups"] = [
            {
                "path": str(p.relative_to(base)),
                "owner": p.stat().st_uid,
                "controllers": (p / "cgroup.controllers").read_text().split(),
            }
            for p in nested
        ]
        _sandbox(plan, "docker rm -f $(docker ps -aq) >/dev/null 2>&1 || true")
        return found
    finally:
        local_cvm.destroy(plan)
        for path in sorted(base.parent.glob(f"{plan.cvm_id}*"), reverse=True):
            for child in sorted(path.rglob("*"), key=lambda p: -len(p.parts)):
                if child.is_dir():
                    child.rmdir()
            path.rmdir()


def main() -> None:
    root, prefix = Path(sys.argv[1]), sys.argv[2]
    print(json.dumps(probe(root, prefix)))


if __name__ == "__main__":
    main()
