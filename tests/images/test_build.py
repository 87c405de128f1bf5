"""Container images from Debian packages and the project's wheel, with no registry: the same
inputs give the same digests (built twice here), the package lock is enforced, and the built
image really runs under a real Docker engine (started by scripts/docker-up)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from umbra.images.build import BuildError, check_lock
from umbra.images.recipes import Rootfs

from .conftest import docker_up

# Two full rootfs builds (mmdebstrap + wheel install) run in the first test's setup.
pytestmark = pytest.mark.timeout(1500)


def test_same_inputs_give_the_same_image_digests(
    runtime_builds: tuple[Path, dict[str, dict[str, str]], dict[str, dict[str, str]]],
) -> None:
    out, a, b = runtime_builds
    # No forwarder or ingress image: on a Dev CVM both are host processes (sandbox/dev_host.py).
    assert sorted(a) == ["console", "proxy"]
    assert a == b
    print("reproducible:", {n: i["manifest_digest"] for n, i in a.items()})
    prov = json.loads((out / "provenance.runtime.intoto.json").read_text())
    deps = prov["predicate"]["buildDefinition"]["resolvedDependencies"]
    assert any(d["uri"].startswith("pkg:deb/debian/libc6@") for d in deps)
    assert any(d["uri"].startswith("file:umbra-") for d in deps)
    assert {s["digest"]["sha256"] for s in prov["subject"]} == {
        i["manifest_digest"][7:] for i in a.values()
    }


def test_built_image_loads_and_runs_umbra(
    runtime_builds: tuple[Path, dict[str, dict[str, str]], dict[str, dict[str, str]]],
) -> None:
    docker_up()
    out, images, _ = runtime_builds
    fwd = images["proxy"]
    tag = f"umbra/proxy:{fwd['config_digest'][7:19]}"
    subprocess.run(["docker", "load", "-i", str(out / fwd["archive"])], check=True)
    try:
        got = subprocess.run(
            ["docker", "image", "inspect", "-f", "{{.Id}} {{.Config.User}}", tag],
            capture_output=True, text=True, check=True,
        ).stdout.split()  # fmt: skip
        assert got == [fwd["config_digest"], "65534:65534"]
        ran = subprocess.run(
            ["docker", "run", "--rm", "--network", "none", fwd["config_digest"],
             "umbra", "proxy", "--help"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert ran.returncode == 0, ran.stderr
        assert "serve" in ran.stdout
        # Bytecode built in (images/build.compile_python): hash-based, the image's own paths.
        probe = (
            "import marshal, umbra.proxy.runner as m, json;"
            "b = open(m.__cached__, 'rb').read();"
            "print(json.dumps([int.from_bytes(b[4:8], 'little'),"
            " marshal.loads(b[16:]).co_filename, m.__file__]))"
        )
        ran = subprocess.run(
            ["docker", "run", "--rm", "--network", "none", "--read-only", fwd["config_digest"],
             "/opt/python/bin/python3.12", "-c", probe],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert ran.returncode == 0, ran.stderr
        flags, co_filename, source = json.loads(ran.stdout)
        assert flags == 1 and co_filename == source  # hash-based, unchecked
    finally:
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True)


def test_lock_mismatch_is_refused_with_each_difference() -> None:
    with pytest.raises(BuildError) as exc:
        check_lock(
            Rootfs.RUNTIME,
            {"libc6": "2.36-9+deb12u99", "extra": "1"},
            {"libc6": "2.36-9+deb12u14", "gone": "2"},
        )
    msg = str(exc.value)
    assert "libc6: locked 2.36-9+deb12u14, got 2.36-9+deb12u99" in msg
    assert "extra: 1 installed but not in the lock" in msg
    assert "gone: locked 2, not installed" in msg
