"""The CVM OS image: Debian 13 (trixie) with trixie-backports' cloud kernel (a TDX guest: Linux
7.x with configfs-tsm quotes and TSM measurement registers), systemd, Docker, CPython 3.12 + the
umbra wheel, and the launch agent unit, from one definition per cloud (images/os/*.yaml).

Output: `rootfs.ext4` (the root file system, built with `mke2fs -d`: no loop mounts), and beside
it the kernel, the initrd and systemd's UEFI stub (`linuxx64.efi.stub`, Debian's systemd-boot-efi
from the same suite), which images.uki joins into the Unified Kernel Image the disk boots
(images.disk_formats: ESP + root partition; the CI boot test boots that disk under OVMF).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from umbra.components import idle_stop
from umbra.contracts.validation import first_problem
from umbra.images.build import (
    BuildError,
    _run,
    _workdir,
    compile_python,
    copy_python,
    install_wheel,
    installed_packages,
    normalize,
)
from umbra.images.disk_formats import ROOT_PART_UUID, VERITY_PART_UUID
from umbra.images.image_store import ARCHIVE_SUFFIX, IMAGES_DIR
from umbra.images.lock_policy import Drift, LockPolicy
from umbra.images.os_lock import OS_SUITE, lock_os_packages

OS_DIR = Path(__file__).parent / "os"
# OS_SUITE (os_lock): trixie, and the kernel from trixie-backports.
OS_MIRRORS = (
    "deb http://deb.debian.org/debian trixie main",
    "deb http://deb.debian.org/debian trixie-updates main",
    "deb http://deb.debian.org/debian-security trixie-security main",
    "deb http://deb.debian.org/debian trixie-backports main",
)
# What the host's CPython 3.12 links (recipes.PY_LIBS, under trixie's 64-bit time_t names).
OS_PY_LIBS = (
    "libssl3t64", "libffi8", "libsqlite3-0", "zlib1g", "libbz2-1.0", "liblzma5", "libexpat1",
    "libncursesw6", "libreadline8t64", "libtirpc3t64", "ca-certificates",
)  # fmt: skip
UNIT = OS_DIR / "umbra-launch-agent.service"
# Installed, never enabled: the launch agent starts it on a Dev CVM (images/launch_ingress.py).
INGRESS_UNIT = OS_DIR / "umbra-ingress.service"
# Debian's own sshd units: the only sshd on a CVM is the ingress's per-connection `sshd -i`.
MASKED_UNITS = ("ssh.service", "ssh.socket")
# Enabled by their packages, not started at boot: the launch agent starts Docker for a compose
# role only (launch_agent.start_docker_engine). On a Dev CVM a host dockerd is attack surface
# the sandbox does not need, and its ruleset (iptables FORWARD policy drop) cut the forwarder's
# egress: found on the emulated GCP, where the Dev CVM's enrollment timed out.
DISABLED_UNITS = (
    "multi-user.target.wants/docker.service",
    "multi-user.target.wants/containerd.service",
    "sockets.target.wants/docker.socket",
)
# systemd (>= 256, trixie's 257) generates sshd sockets of its own when sshd is installed:
# `sshd-unix-local.socket` always, `sshd-vsock.socket` on a VM with an AF_VSOCK device, which
# the host controls: an sshd the host could reach past the attested ingress. Masked by an
# /etc generator of the same name linked to /dev/null (systemd.generator(7)); /etc is on the
# verity root, so the host cannot unmask it.
MASKED_GENERATORS = ("systemd-ssh-generator",)
STUB_PATH = "usr/lib/systemd/boot/efi/linuxx64.efi.stub"
# The initramfs's dm-verity root and tmpfs overlays (images/os/initramfs): installed under
# /etc/initramfs-tools, then the initrd is made again; the build checks it carries them.
INITRAMFS_DIR = OS_DIR / "initramfs"
INITRAMFS_FILES = {
    "hook": "etc/initramfs-tools/hooks/umbra-verity",
    "tee": "etc/initramfs-tools/scripts/init-top/umbra-tee",
    "local-top": "etc/initramfs-tools/scripts/local-top/umbra-verity",
    "init-bottom": "etc/initramfs-tools/scripts/init-bottom/umbra-overlay",
}
# tdx-guest (the RTMR sysfs files, TSM_MEASUREMENTS), tsm_report (configfs-tsm quotes) and
# configfs: loaded by the initramfs (local-top) so they are there before the launch agent.
INITRD_MUST_HAVE = (
    "usr/sbin/veritysetup", "usr/sbin/umbra-mount", "dm-verity.ko", "overlay.ko",
    "tdx-guest.ko", "tsm_report.ko", "configfs.ko",
)  # fmt: skip
# The root is read-only (dm-verity; no fstab entry, so nothing remounts it). /etc and /var are
# overlays made by the initramfs; these are plain tmpfs: /tmp, and docker's data-root (overlay2
# cannot sit on the /var overlay).
FSTAB = (
    "# / is /dev/mapper/umbra-root (dm-verity, read-only), opened and mounted by the initramfs.\n"
    "tmpfs /tmp tmpfs mode=1777,nosuid,nodev 0 0\n"
    "tmpfs /var/lib/docker tmpfs mode=0710 0 0\n"
)


class LaunchAgentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    env: dict[str, str]


class OsDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    cloud: Literal["gcp", "azure", "qemu"]
    boot: Literal["uefi"]
    kernel: str
    packages: list[str] = Field(min_length=1)
    launch_agent: LaunchAgentConfig
    guest_os_features: list[str] = Field(default_factory=list)
    machine_type: str | None = None
    confidential_instance_type: str | None = None
    hyper_v_generation: str | None = None
    security_type: str | None = None
    disk_format: str | None = None
    # Ship the sandbox image (sandbox/image.py's tree, built on the build host) at
    # SANDBOX_IMAGE_DIR: a Dev CVM's dev host runs it (sandbox/dev_host.py).
    sandbox_image: bool = False


def install_ingress_unit(unit_dir: Path) -> None:
    """The attested ingress's unit (started by the launch agent only); Debian's sshd units and
    systemd's sshd socket generator masked."""
    shutil.copyfile(INGRESS_UNIT, unit_dir / INGRESS_UNIT.name)
    generators = unit_dir.parent / "system-generators"
    generators.mkdir(exist_ok=True)
    for masked in [unit_dir / n for n in MASKED_UNITS] + [
        generators / n for n in MASKED_GENERATORS
    ]:
        masked.unlink(missing_ok=True)
        masked.symlink_to("/dev/null")


def load_os_definition(path: Path) -> OsDefinition:
    try:
        return OsDefinition.model_validate(yaml.safe_load(path.read_text()))
    except (OSError, yaml.YAMLError) as exc:
        raise BuildError(f"{path}: cannot read: {exc}") from None
    except ValidationError as exc:
        raise BuildError(f"{path}: {first_problem(exc)}") from None


# Beside rootfs.ext4 when the build accepted lock drift (lock_policy): one line per package, so
# the image directory says which versions the image really holds.
LOCK_DRIFT_NAME = "lock-drift.txt"


@dataclass(frozen=True)
class OsImage:
    rootfs: Path
    kernel: Path
    initrd: Path
    stub: Path
    lock_drift: tuple[Drift, ...] = ()


def build_os_image(
    d: OsDefinition,
    out: Path,
    *,
    wheel: Path,
    requirements: Path,
    host_python_prefix: Path,
    epoch: int,
    extra_files: dict[str, str] | None = None,
    image_archives: Sequence[Path] = (),
    size: str | None = None,
    update_lock: bool = False,
    lock_policy: LockPolicy = LockPolicy.STRICT,
) -> OsImage:
    """The installed packages must be the lock's for `d.cloud` (images/os/packages.lock,
    os_lock), exactly under the strict `lock_policy` (releases); `update_lock` rewrites those
    lines from this build first. `size`: the root file system's (default 3G; 6G with the sandbox
    image, whose tree alone is over 2 GiB)."""
    import os

    out.mkdir(parents=True, exist_ok=True)
    with _workdir() as work:
        root = work / "rootfs"
        env = os.environ | {"SOURCE_DATE_EPOCH": str(epoch), "LC_ALL": "C.UTF-8"}
        _run(
            [
                "mmdebstrap",
                "--mode=root",
                "--variant=minbase",
                "--format=directory",
                # The apt indices tell lock_policy which suite offers a version; normalize()
                # removes them before the image is written.
                "--skip=cleanup/apt/lists",
                "--include=" + ",".join(_packages(d)),
                *_initramfs_hooks(work),
                OS_SUITE,
                str(root),
                *OS_MIRRORS,
            ],
            "mmdebstrap (OS image)",
            env=env,
        )
        drift = lock_os_packages(
            d.cloud, installed_packages(root), update=update_lock, policy=lock_policy, root=root
        )
        record = out / LOCK_DRIFT_NAME
        record.unlink(missing_ok=True)
        if drift:
            record.write_text("".join(x.line() + "\n" for x in drift))
        copy_python(host_python_prefix, root)
        install_wheel(wheel, requirements, host_python_prefix / "bin/python3.12", root)
        configure_rootfs(d, root)
        for rel, content in (extra_files or {}).items():
            path = root / rel.lstrip("/")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)
            if rel.startswith(("/usr/local/bin/", "usr/local/bin/")):
                path.chmod(0o755)
        install_image_archives(root, image_archives)
        if d.sandbox_image:
            install_sandbox_image(root)
        kernel, initrd = _kernel_and_initrd(root, d.kernel)
        shutil.copyfile(kernel, out / "vmlinuz")
        shutil.copyfile(initrd, out / "initrd.img")
        stub = root / STUB_PATH
        if not stub.is_file():
            raise BuildError(f"systemd-boot-efi: no {STUB_PATH} in the rootfs")
        shutil.copyfile(stub, out / stub.name)
        normalize(root)
        compile_python(root, host_python_prefix / "bin/python3.12")
        image = out / "rootfs.ext4"
        image.unlink(missing_ok=True)
        _run(
            ["mke2fs", "-q", "-t", "ext4", "-E", f"root_owner=0:0,hash_seed={_SEED}",
             "-U", _SEED, "-L", "umbra-root", "-d", str(root), str(image),
             size or ("6G" if d.sandbox_image else "3G")],
            "mke2fs",
            env=env,
        )  # fmt: skip
    stub_out = out / "linuxx64.efi.stub"
    return OsImage(image, out / "vmlinuz", out / "initrd.img", stub_out, tuple(drift))


def configure_rootfs(d: OsDefinition, root: Path) -> None:
    """Everything of Umbra's the build writes into the mmdebstrapped rootfs `root` besides the
    Python tree: the units (the launch agent's enabled; the ingress's and idle stop's installed,
    not enabled), the agent's environment, networkd, fstab, hostname."""
    unit_dir = root / "etc/systemd/system"
    wants = unit_dir / "multi-user.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    for link in DISABLED_UNITS:
        (unit_dir / link).unlink(missing_ok=True)
    units = [UNIT]
    for unit in units:
        shutil.copyfile(unit, unit_dir / unit.name)
        (wants / unit.name).symlink_to(f"/etc/systemd/system/{unit.name}")
    if "openssh-server" in d.packages:
        install_ingress_unit(unit_dir)
    # Idle auto-stop's script and units, not enabled: the agent arms it on a Dev CVM only.
    idle_stop.install_files(root)
    conf = root / "etc/umbra"
    conf.mkdir(parents=True, exist_ok=True)
    (conf / "launch-agent.env").write_text(
        "".join(f"{k}={v}\n" for k, v in sorted(d.launch_agent.env.items()))
    )
    for name, target in (
        ("systemd-networkd.service", "multi-user.target.wants"),
        ("systemd-networkd-wait-online.service", "network-online.target.wants"),
    ):
        (unit_dir / target).mkdir(parents=True, exist_ok=True)
        (unit_dir / target / name).symlink_to(f"/lib/systemd/system/{name}")
    net = root / "etc/systemd/network/20-dhcp.network"
    net.parent.mkdir(parents=True, exist_ok=True)
    net.write_text("[Match]\nName=en* eth*\n\n[Network]\nDHCP=ipv4\n")
    (root / "etc/fstab").write_text(FSTAB)
    (root / "etc/hostname").write_text("umbra-cvm\n")


def _packages(d: OsDefinition) -> list[str]:
    # cryptsetup-bin: veritysetup, which the initramfs hook copies into the initrd.
    # linux-base/trixie-backports: the backports kernel pre-depends on linux-base >= 4.17
    # (trixie has 4.12), and apt takes a backports package only when asked by release.
    base = [d.kernel, "linux-base/trixie-backports", "initramfs-tools", "systemd-boot-efi",
            "cryptsetup-bin"]  # fmt: skip
    return [*base, *OS_PY_LIBS, *d.packages]


def _kernel_and_initrd(root: Path, package: str) -> tuple[Path, Path]:
    """The one installed kernel (backports' 7.x ships it under /usr/lib/modules/VERSION/ and
    links it into /boot) and its initrd; two kernels would make the UKI's choice ambiguous."""
    versions = sorted(p.parent.name for p in (root / "usr/lib/modules").glob("*/modules.order"))
    if len(versions) != 1:
        raise BuildError(f"{package}: expected one installed kernel, found {versions or 'none'}")
    (v,) = versions
    kernel = next(
        (p for p in (root / f"boot/vmlinuz-{v}", root / f"usr/lib/modules/{v}/vmlinuz")
         if p.is_file()), None,
    )  # fmt: skip
    initrd = root / f"boot/initrd.img-{v}"
    if kernel is None or not initrd.is_file():
        raise BuildError(f"{package}: no kernel or initrd for {v} in the rootfs")
    return kernel, initrd


def _initramfs_hooks(work: Path) -> list[str]:
    """mmdebstrap customize hooks (run with /proc, /sys, /dev mounted): install the initramfs
    files with the partitions' fixed GPT ids filled in, make the initrd again, and fail the
    build if it lacks what the boot needs (a missing file would only warn in mkinitramfs)."""
    staged = work / "initramfs"
    for name, rel in INITRAMFS_FILES.items():
        text = (INITRAMFS_DIR / name).read_text()
        text = text.replace("@ROOT_PART_UUID@", ROOT_PART_UUID)
        text = text.replace("@VERITY_PART_UUID@", VERITY_PART_UUID)
        target = staged / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        target.chmod(0o755)
    check = " && ".join(
        f"lsinitramfs /boot/initrd.img-* | grep -q '{f}' "
        f"|| {{ echo 'initrd lacks {f}' >&2; exit 1; }}"
        for f in INITRD_MUST_HAVE
    )
    return [
        f'--customize-hook=cp -a {staged}/etc/. "$1/etc/"',
        '--customize-hook=chroot "$1" update-initramfs -u -k all',
        f'--customize-hook=chroot "$1" sh -c "{check}"',
    ]


def install_image_archives(root: Path, archives: Sequence[Path]) -> list[Path]:
    """Copy the release's image archives to where the launch agent's runner loads them
    (image_store.IMAGES_DIR): root-owned, 0644, one file per archive name. Their content is
    checked at boot against the measured compose's digest pins, not here."""
    dest = root / IMAGES_DIR.relative_to("/")
    dest.mkdir(parents=True, exist_ok=True, mode=0o755)
    names: set[str] = set()
    out = []
    for archive in archives:
        if not archive.name.endswith(ARCHIVE_SUFFIX):
            raise BuildError(f"{archive}: an image archive is named *{ARCHIVE_SUFFIX}")
        if archive.name in names:
            raise BuildError(f"{archive.name}: two image archives with one name")
        names.add(archive.name)
        if not archive.is_file():
            raise BuildError(f"{archive}: no such image archive")
        target = dest / archive.name
        shutil.copyfile(archive, target)
        target.chmod(0o644)
        out.append(target)
    return out


SANDBOX_IMAGE_DIR = Path("/usr/lib/umbra/sandbox-image")


def install_sandbox_image(root: Path) -> Path:
    """Copy the sandbox image's two layers (its base tree and Umbra's files) under their keys,
    in the build cache's layout, so the dev host finds exactly the tree its release measures."""
    from umbra.sandbox import image

    base, files = image.cached_rootfs(), image.cache_root() / "files" / image.files_key()
    if base is None or not (files / "ready").exists():
        raise BuildError(
            "the sandbox image is not built on this build host: `umbra up` (or "
            "umbra.sandbox.image.ensure_image) builds it first"
        )
    dest = root / SANDBOX_IMAGE_DIR.relative_to("/")
    for source, target in (
        (base.parent, dest / image.recipe_key()),
        (files, dest / "files" / image.files_key()),
    ):
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        # -a: owners, modes, links and xattrs (file capabilities) as the build made them.
        _run(["cp", "-a", str(source), str(target)], f"copying the sandbox image to {target}")
    return dest


# Fixed UUID and hash seed: the file system carries no random ids.
_SEED = "0d3c9a52-6b8e-4f5a-9d0b-2f1e0c7b4a11"
