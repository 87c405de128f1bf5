"""Build inputs shared by the image build tests: the project's wheel and its locked requirements,
made once per session (uv build --wheel; uv export --frozen). The test builds hold the rootfs to
the package locks under the `security-updates` policy (images.lock_policy), so a Debian security
or point update does not fail them; each accepted drift is a pytest warning in the summary."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from umbra.cli.app import app
from umbra.images.disk_formats import CloudDisks
from umbra.images.lock_policy import LockPolicy
from umbra.images.os_image import (
    OS_DIR,
    LaunchAgentConfig,
    OsDefinition,
    OsImage,
    build_os_image,
    load_os_definition,
)
from umbra.images.uki import Uki, UkiSigner, pack_os_image

from .sb_keys import make_signer

ROOT = Path(__file__).resolve().parents[2]
EPOCH = "1700000000"
# Releases are strict (the CLI's default); the tests accept the mirror's security/point updates.
TEST_LOCK_POLICY = LockPolicy.SECURITY_UPDATES


def warn_drift(lines: list[str]) -> None:
    for line in lines:
        warnings.warn(line, stacklevel=2)


def need_root_and(cmd: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("image builds need root (mmdebstrap --mode=root; CI runs as root)")
    if shutil.which(cmd) is None:
        pytest.skip(f"needs {cmd} (scripts/system-deps installs it)")


@pytest.fixture(scope="session")
def build_inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    need_root_and("mmdebstrap")
    d = tmp_path_factory.mktemp("uim-inputs")
    subprocess.run(["uv", "build", "--wheel", "-q", "-o", str(d)], cwd=ROOT, check=True)
    req = subprocess.run(
        ["uv", "export", "--frozen", "--no-dev", "--no-emit-project", "-q"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    (d / "requirements.txt").write_text(req)
    return next(d.glob("umbra-*.whl")), d / "requirements.txt"


# Local iteration only (CI never sets it): reuse images `umbra image build` wrote into this
# directory instead of building them. The reproducibility test then compares a build with itself.
# An `os-qemu` subdirectory (an OS image build's output) stands in for the `qemu` OS image.
PREBUILT = os.environ.get("UMBRA_TEST_PREBUILT")


def _prebuilt(rootfs: str) -> tuple[Path, dict[str, dict[str, str]]] | None:
    if not PREBUILT:
        return None
    d = Path(PREBUILT)
    images: dict[str, dict[str, str]] = json.loads((d / f"images.{rootfs}.json").read_text())
    return d, images


@pytest.fixture(scope="session")
def runtime_builds(
    build_inputs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, dict[str, str]], dict[str, dict[str, str]]]:
    """The `runtime` images built twice from the same inputs (the first build's dir, both
    builds' image tables)."""
    pre = _prebuilt("runtime")
    if pre is not None:
        return pre[0], pre[1], pre[1]
    first, second = tmp_path_factory.mktemp("uim-b1"), tmp_path_factory.mktemp("uim-b2")
    a, b = build_runtime(first, *build_inputs), build_runtime(second, *build_inputs)
    shutil.rmtree(second)  # only its digests are compared (its archives: ~0.8 GB till the end)
    return first, a, b


def build_runtime(out: Path, wheel: Path, req: Path) -> dict[str, dict[str, str]]:
    done = CliRunner().invoke(
        app,
        ["image", "build", "runtime", "--out", str(out), "--wheel", str(wheel),
         "--requirements", str(req), "--source-date-epoch", EPOCH, "--without-tools",
         "--lock-policy", str(TEST_LOCK_POLICY), "--json"],
    )  # fmt: skip
    assert done.exit_code == 0, done.output
    result = json.loads(done.stdout)
    warn_drift(result["lock_drift"])
    images: dict[str, dict[str, str]] = result["images"]
    return images


def docker_up() -> None:
    need_root_and("docker")
    done = subprocess.run([str(ROOT / "scripts/docker-up")], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"scripts/docker-up could not start a Docker engine:\n{done.stderr}")


@pytest.fixture(scope="session")
def qemu_os_image(
    build_inputs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> OsImage:
    """The `qemu` OS image's stub variant (`stub_variant`), built once: packed once into
    `qemu_disks` (booted by the boot tests), and once more by the disk-format test
    (reproducibility)."""
    from .test_qemu_boot import STUB

    if PREBUILT and (Path(PREBUILT) / "os-qemu").is_dir():
        return _prebuilt_os(Path(PREBUILT) / "os-qemu")
    return build_qemu_os(tmp_path_factory.mktemp("uim-os"), *build_inputs, STUB)


STUB_PATH = "/usr/local/bin/umbra-compose-stub"


def stub_variant(d: OsDefinition) -> OsDefinition:
    """`d` (qemu.yaml) with the agent handing the compose to a stub at STUB_PATH (no dev host,
    no ingress) and no sandbox image (2 GiB a stub never runs): the boot tests' image, which
    report what they check on the serial console and boot in seconds, not minutes."""
    args = f"--console /dev/ttyS0 --compose {STUB_PATH} --no-ingress"
    env = d.launch_agent.env | {"UMBRA_AGENT_ARGS": args}
    return d.model_copy(update={"sandbox_image": False, "launch_agent": LaunchAgentConfig(env=env)})


def build_qemu_os(out: Path, wheel: Path, req: Path, stub: str) -> OsImage:
    """`qemu.yaml`'s stub variant, with `stub` as its compose runner."""
    return _build_os(stub_variant(load_os_definition(OS_DIR / "qemu.yaml")), out, wheel, req,
                     extra_files={STUB_PATH: stub})  # fmt: skip


def _build_os(d: OsDefinition, out: Path, wheel: Path, req: Path, **kw: Any) -> OsImage:
    """A test build: the session's wheel, the tolerant lock policy, each drift a warning."""
    image = build_os_image(d, out, wheel=wheel, requirements=req,
                           host_python_prefix=Path(sys.base_prefix), epoch=int(EPOCH),
                           lock_policy=TEST_LOCK_POLICY, **kw)  # fmt: skip
    warn_drift([d.line() for d in image.lock_drift])
    return image


def _prebuilt_os(d: Path) -> OsImage:
    return OsImage(d / "rootfs.ext4", d / "vmlinuz", d / "initrd.img", d / "linuxx64.efi.stub")


@pytest.fixture(scope="session")
def sb_signer(tmp_path_factory: pytest.TempPathFactory) -> UkiSigner:
    """This run's throwaway Secure Boot release key and certificate."""
    return make_signer(tmp_path_factory.mktemp("uim-sb"))


@pytest.fixture(scope="session")
def qemu_disks(
    qemu_os_image: OsImage, sb_signer: UkiSigner, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Uki, CloudDisks]:
    """The `qemu` OS image packed as bootable disks (ESP with the UKI, signed with this run's
    Secure Boot key, + root), once."""
    need_root_and("sfdisk")
    need_root_and("osslsigncode")
    return pack_os_image(
        qemu_os_image.rootfs.parent, tmp_path_factory.mktemp("uim-disks"), int(EPOCH), sb_signer
    )


@pytest.fixture(scope="session")
def cvm_disk() -> tuple[Path, dict[str, dict[str, str]]]:
    """The `qemu` OS image as the emulated clouds boot both roles (its packed disk.raw), built by
    `umbra up --runtime qemu`'s own builder (cli/up_stack/os_disk.ensure_disk): `qemu.yaml` as
    shipped (the agent's defaults, Docker, runc, the sandbox image from this build host's cache)
    plus the proxy image of its own `runtime` build, packed without Secure Boot
    (test_secure_boot.py covers it), into its cache by its inputs' key, where
    tests/up/test_up_qemu_boot.py finds it: one build for both. `disks-qemu-cvm/disk.raw` in
    UMBRA_TEST_PREBUILT stands in for it (local iteration)."""
    from umbra.cli.up_stack import os_disk

    if PREBUILT and (Path(PREBUILT) / "disks-qemu-cvm").is_dir():
        pre = _prebuilt("runtime")
        assert pre is not None
        return Path(PREBUILT) / "disks-qemu-cvm" / "disk.raw", pre[1]
    need_root_and("sfdisk")
    disk = os_disk.ensure_disk(lambda line: print(line, flush=True))
    return disk.raw, {"proxy": {"manifest_digest": disk.proxy_digest}}
