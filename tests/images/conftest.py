"""Build inputs shared by the image build tests: the project's wheel and its locked requirements,
made once per session (uv build --wheel; uv export --frozen)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from umbra.cli.app import app
from umbra.images.disk_formats import CloudDisks
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
    return first, build_runtime(first, *build_inputs), build_runtime(second, *build_inputs)


def build_runtime(out: Path, wheel: Path, req: Path) -> dict[str, dict[str, str]]:
    done = CliRunner().invoke(
        app,
        ["image", "build", "runtime", "--out", str(out), "--wheel", str(wheel),
         "--requirements", str(req), "--source-date-epoch", EPOCH, "--without-tools", "--json"],
    )  # fmt: skip
    assert done.exit_code == 0, done.output
    images: dict[str, dict[str, str]] = json.loads(done.stdout)["images"]
    return images


def docker_up() -> None:
    need_root_and("docker")
    done = subprocess.run([str(ROOT / "scripts/docker-up")], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"scripts/docker-up could not start a Docker engine:\n{done.stderr}")


def stub_variant(d: OsDefinition) -> OsDefinition:
    """The boot tests' variant of `qemu.yaml`: the same packages and kernel, but the agent hands
    the compose to a stub that reports the root, Secure Boot, the data disk and a quote on the
    serial console (`--compose … --no-ingress`: no dev host, no ingress), and no sandbox image
    (2 GiB the stub never runs). The real Dev workload boots in test_emulated_dev_cvm.py."""
    env = d.launch_agent.env | {
        "UMBRA_AGENT_ARGS": "--console /dev/ttyS0 --compose /usr/local/bin/umbra-compose-stub "
        "--no-ingress"
    }
    return d.model_copy(update={"sandbox_image": False, "launch_agent": LaunchAgentConfig(env=env)})


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
    wheel, req = build_inputs
    return build_os_image(
        stub_variant(load_os_definition(OS_DIR / "qemu.yaml")),
        tmp_path_factory.mktemp("uim-os"),
        wheel=wheel,
        requirements=req,
        host_python_prefix=Path(sys.base_prefix),
        epoch=int(EPOCH),
        extra_files={"/usr/local/bin/umbra-compose-stub": STUB},
    )


def _prebuilt_os(d: Path) -> OsImage:
    return OsImage(d / "rootfs.ext4", d / "vmlinuz", d / "initrd.img", d / "linuxx64.efi.stub")


@pytest.fixture(scope="session")
def qemu_dev_os_image(
    build_inputs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> OsImage:
    """`qemu.yaml` as it is: the dev host, the sandbox image (this build host's cache, built
    first if missing) and the attested ingress. `UMBRA_TEST_PREBUILT/os-qemu-dev` stands in."""
    from umbra.sandbox import image

    if PREBUILT and (Path(PREBUILT) / "os-qemu-dev").is_dir():
        return _prebuilt_os(Path(PREBUILT) / "os-qemu-dev")
    wheel, req = build_inputs
    image.ensure_image()
    return build_os_image(
        load_os_definition(OS_DIR / "qemu.yaml"),
        tmp_path_factory.mktemp("uim-os-dev"),
        wheel=wheel,
        requirements=req,
        host_python_prefix=Path(sys.base_prefix),
        epoch=int(EPOCH),
    )


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
def qemu_dev_disks(
    qemu_dev_os_image: OsImage, sb_signer: UkiSigner, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Uki, CloudDisks]:
    """`qemu_dev_os_image` packed as bootable disks, once."""
    need_root_and("sfdisk")
    need_root_and("osslsigncode")
    return pack_os_image(
        qemu_dev_os_image.rootfs.parent,
        tmp_path_factory.mktemp("uim-dev-disks"),
        int(EPOCH),
        sb_signer,
    )
