"""Container images from Debian packages and the project's wheel, with no registry: the same
inputs give the same digests (built twice here), the package lock is enforced, and the built
image really runs under a real Docker engine (started by scripts/docker-up)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from umbra.cli.app import app
from umbra.images.build import BuildError, check_lock
from umbra.images.recipes import Rootfs

from .conftest import need_root_and

ROOT = Path(__file__).resolve().parents[2]
EPOCH = "1700000000"
runner = CliRunner()
# Two full rootfs builds (mmdebstrap + wheel install) run in the first test's setup.
pytestmark = pytest.mark.timeout(1500)


def _build(out: Path, wheel: Path, req: Path) -> dict[str, dict[str, str]]:
    done = runner.invoke(
        app,
        ["image", "build", "runtime", "--out", str(out), "--wheel", str(wheel),
         "--requirements", str(req), "--source-date-epoch", EPOCH, "--json"],
    )  # fmt: skip
    assert done.exit_code == 0, done.output
    images: dict[str, dict[str, str]] = json.loads(done.stdout)["images"]
    return images


@pytest.fixture(scope="module")
def built(
    build_inputs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, dict[str, str]], dict[str, dict[str, str]]]:
    first, second = tmp_path_factory.mktemp("uim-b1"), tmp_path_factory.mktemp("uim-b2")
    a = _build(first, *build_inputs)
    b = _build(second, *build_inputs)
    return first, a, b


def test_same_inputs_give_the_same_image_digests(
    built: tuple[Path, dict[str, dict[str, str]], dict[str, dict[str, str]]],
) -> None:
    out, a, b = built
    assert sorted(a) == ["console", "forwarder", "ingress", "proxy", "sshd"]
    assert a == b
    print("reproducible:", {n: i["manifest_digest"] for n, i in a.items()})
    prov = json.loads((out / "provenance.runtime.intoto.json").read_text())
    deps = prov["predicate"]["buildDefinition"]["resolvedDependencies"]
    assert any(d["uri"].startswith("pkg:deb/debian/libc6@") for d in deps)
    assert any(d["uri"].startswith("file:umbra-") for d in deps)
    assert {s["digest"]["sha256"] for s in prov["subject"]} == {
        i["manifest_digest"][7:] for i in a.values()
    }


@pytest.fixture
def docker() -> None:
    need_root_and("docker")
    done = subprocess.run([str(ROOT / "scripts/docker-up")], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"scripts/docker-up could not start a Docker engine:\n{done.stderr}")


def test_built_image_loads_and_runs_umbra(
    built: tuple[Path, dict[str, dict[str, str]], dict[str, dict[str, str]]], docker: None
) -> None:
    out, images, _ = built
    fwd = images["forwarder"]
    tag = f"umbra/forwarder:{fwd['config_digest'][7:19]}"
    subprocess.run(["docker", "load", "-i", str(out / fwd["archive"])], check=True)
    try:
        got = subprocess.run(
            ["docker", "image", "inspect", "-f", "{{.Id}} {{.Config.User}}", tag],
            capture_output=True, text=True, check=True,
        ).stdout.split()  # fmt: skip
        assert got == [fwd["config_digest"], "65534:65534"]
        ran = subprocess.run(
            ["docker", "run", "--rm", "--network", "none", fwd["config_digest"],
             "umbra", "forwarder", "--help"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert ran.returncode == 0, ran.stderr
        assert "serve" in ran.stdout
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
