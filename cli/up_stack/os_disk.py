"""`umbra up --runtime qemu`: the built `qemu` OS image packed as its boot disk, made once per
set of inputs and cached (`/var/cache/umbra/os-qemu/<key>/disk.raw`, `UMBRA_OS_IMAGE_CACHE`).

The image is `qemu.yaml` as shipped, the build the emulated clouds boot for both roles: the
launch agent's defaults, Docker, the dev host (runc, the sandbox image below, the forwarder), the
attested SSH ingress, and the release's proxy image archive (`umbra image build runtime`, its
digest in `images.json` beside the disk: the Security release names it).

The key is a SHA-256 over everything the image is made of: the definition (images/os/qemu.yaml)
and its package lock, every source file of the project that the wheel ships, pyproject.toml and
uv.lock (the wheel and its locked requirements), the sandbox image's recipe and files keys and
the build epoch. So a changed line of Umbra makes a new image (the image carries the code), and
an unchanged tree never rebuilds. The build is `umbra image os-build` + `umbra image disks` in
process (mmdebstrap, as root): minutes, with progress. A development build: the package locks
hold under `security-updates` (a Debian security or point update of a locked package is accepted
and printed; anything else refused), not `strict` as a release's. No Secure Boot key: the UKI
is unsigned and OVMF boots it with Secure Boot off (the signed path is
tests/images/test_secure_boot.py's).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from umbra.cli.up_stack.errors import UpError
from umbra.contracts.files import exclusive_lock

DEFAULT_CACHE = Path("/var/cache/umbra/os-qemu")
CACHE_ENV = "UMBRA_OS_IMAGE_CACHE"
# Tests and local iteration only: a packed disk.raw used as is (no key, no build), with the
# `images.json` of the proxy image it carries beside it.
DISK_ENV = "UMBRA_UP_QEMU_DISK"
IMAGES = "images.json"
EPOCH = 1700000000
ESTIMATE = "about 8 minutes on 2 cores, once the sandbox image is cached"
# The wheel's packages (pyproject.toml [tool.hatch.build.targets.wheel]).
PACKAGES = (
    "cli", "console", "proxy", "policy", "attest", "sandbox", "images", "components",
    "contracts", "emulated",
)  # fmt: skip

Progress = Callable[[str], None]


def project_root() -> Path:
    """The source checkout this `umbra` runs from (the image is built from it)."""
    import umbra.cli

    root = Path(umbra.cli.__file__).resolve().parents[1]
    if not (root / "pyproject.toml").is_file() or not (root / "uv.lock").is_file():
        raise UpError(
            f"`umbra up --runtime qemu` builds the OS image from a source checkout; {root} is "
            "not one (no pyproject.toml and uv.lock)",
            f"run it from a clone of Umbra, or set {DISK_ENV} to a packed disk.raw",
        )
    return root


def inputs_key(root: Path) -> str:
    """16 hex digits of SHA-256 over every input of the image (module docstring)."""
    from umbra.sandbox import image

    h = hashlib.sha256(f"umbra-os-qemu-v3\0{EPOCH}\0".encode())
    # The sandbox image the OS image carries (its recipe: the agents' pinned versions).
    h.update(f"{image.recipe_key()}\0{image.files_key()}\0".encode())
    files = [root / "pyproject.toml", root / "uv.lock"]
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                files.append(path)
    for path in files:
        h.update(str(path.relative_to(root)).encode() + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()[:16]


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE)


@dataclass(frozen=True)
class OsDisk:
    """The packed image's boot disk and the proxy image it carries (the Security release names
    its digest)."""

    raw: Path
    proxy_digest: str


def _with_images(disk: Path) -> OsDisk:
    """The disk and the manifest digest of its proxy image (`images.json` beside it)."""
    import json

    path = disk.with_name(IMAGES)
    try:
        digest = json.loads(path.read_text())["proxy"]["manifest_digest"]
    except (OSError, ValueError, KeyError, TypeError):
        raise UpError(
            f"{path}: no proxy image digest (the images the disk carries)",
            f"rebuild: remove {disk.parent} and run `umbra up --runtime qemu` again",
        ) from None
    if not isinstance(digest, str) or not digest.startswith("sha256:"):
        raise UpError(f"{path}: proxy.manifest_digest is not a sha256 digest")
    return OsDisk(disk, digest)


def ensure_disk(progress: Progress) -> OsDisk:
    """The packed `qemu` image's disk.raw for the current inputs, built on a miss."""
    given = os.environ.get(DISK_ENV)
    if given:
        disk = Path(given)
        if not disk.is_file():
            raise UpError(f"{DISK_ENV}={given}: no such file", f"unset {DISK_ENV}, or fix it")
        progress(f"warning: {DISK_ENV}: booting {disk} as is (not built from this checkout)")
        return _with_images(disk)
    root = project_root()
    key = inputs_key(root)
    entry = cache_root() / key
    if (entry / "ready").exists():
        return _with_images(entry / "disk.raw")
    for tool, package in (("mmdebstrap", "mmdebstrap"), ("sfdisk", "fdisk"), ("uv", "uv")):
        if shutil.which(tool) is None:
            raise UpError(
                f"building the qemu OS image needs {tool} ({package}), which is not installed",
                "run ./scripts/system-deps as root (uv: scripts/bootstrap)",
            )
    with exclusive_lock(cache_root() / f"{key}.lock"):
        if (entry / "ready").exists():  # another `up` built it while we waited
            return _with_images(entry / "disk.raw")
        shutil.rmtree(entry, ignore_errors=True)
        started = time.monotonic()
        progress(f"building the qemu OS image {key} (once per source tree: {ESTIMATE})")
        try:
            _build(root, entry, progress)
        except BaseException:
            shutil.rmtree(entry, ignore_errors=True)
            raise
        (entry / "ready").write_text(f"{time.monotonic() - started:.0f}\n")
        progress(f"qemu OS image {key} built in {time.monotonic() - started:.0f} s")
        _prune(key)
    return _with_images(entry / "disk.raw")


def _build(root: Path, entry: Path, progress: Progress) -> None:
    import json

    from umbra.images.build import BuildError, build_rootfs
    from umbra.images.disk_formats import DiskFormatError
    from umbra.images.lock_policy import LockPolicy
    from umbra.images.os_image import OS_DIR, build_os_image, load_os_definition
    from umbra.images.recipes import Rootfs
    from umbra.images.uki import pack_os_image
    from umbra.sandbox import image

    definition = load_os_definition(OS_DIR / "qemu.yaml")
    progress("  the sandbox image it carries (built once per machine, then cached)")
    image.ensure_image(progress)
    with tempfile.TemporaryDirectory(prefix="umbra-os-qemu-") as tmp:
        work = Path(tmp)
        progress("  the wheel and its locked requirements (uv build, uv export)")
        _uv(root, ["build", "--wheel", "-q", "-o", str(work / "dist")])
        requirements = work / "requirements.txt"
        requirements.write_text(
            _uv(root, ["export", "--frozen", "--no-dev", "--no-emit-project", "-q"])
        )
        wheel = next((work / "dist").glob("umbra-*.whl"))
        python = Path(sys.base_prefix)
        policy = LockPolicy.SECURITY_UPDATES
        try:
            progress("  the Security CVM's proxy image (umbra image build runtime)")
            runtime = build_rootfs(
                Rootfs.RUNTIME, work / "images", wheel=wheel, requirements=requirements,
                host_python_prefix=python, epoch=EPOCH, lock_policy=policy, without_tools=True,
            )  # fmt: skip
            proxy = next(i for i in runtime.images if i.name == "proxy")
            progress("  the OS image: mmdebstrap, the backports kernel, Python and the wheel")
            os_image = build_os_image(
                definition, work / "os", wheel=wheel, requirements=requirements,
                host_python_prefix=python, epoch=EPOCH, lock_policy=policy,
                image_archives=[proxy.archive],
            )  # fmt: skip
            for drift in [*runtime.lock_drift, *os_image.lock_drift]:
                progress(f"  warning: {drift.line()}")
            progress("  packing it: dm-verity, the UKI, the disk")
            pack_os_image(work / "os", entry, EPOCH, cloud_formats=False)
            images = {"proxy": {"ref": proxy.ref, "manifest_digest": proxy.manifest_digest}}
            (entry / IMAGES).write_text(json.dumps(images))
        except (BuildError, DiskFormatError) as exc:
            raise UpError(
                f"building the qemu OS image failed: {exc}",
                "fix the cause above (scripts/system-deps installs the build tools), then run "
                "`umbra up --runtime qemu` again",
            ) from None


def _uv(root: Path, args: list[str]) -> str:
    done = subprocess.run(
        ["uv", *args], cwd=root, capture_output=True, text=True, check=False, timeout=600
    )
    if done.returncode != 0:
        raise UpError(
            f"building the qemu OS image failed: uv {args[0]}: {done.stderr.strip()[-600:]}",
            "run scripts/bootstrap in the checkout, then `umbra up --runtime qemu` again",
        )
    return done.stdout


def _prune(keep: str) -> None:
    """Older inputs' images go once the new one is ready, unless another build holds them."""
    for old in cache_root().iterdir():
        if not old.is_dir() or old.name == keep or len(old.name) != 16:
            continue
        with exclusive_lock(cache_root() / f"{old.name}.lock", wait=False) as held:
            if held:
                shutil.rmtree(old, ignore_errors=True)
