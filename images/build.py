"""Build container images from Debian packages and the project's wheel, reproducibly, offline of
any container registry: mmdebstrap a rootfs, check every installed package against the lock,
add CPython 3.12 and the wheel, strip run-time state, write one normalized layer, then one
docker-archive per image. Returns the images and every input's digest (for provenance).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from umbra.images.console_tools import ConsoleTools, ToolError, install_console_tools
from umbra.images.lock_policy import Drift, LockPolicy, judge, origins_in, report_drift
from umbra.images.oci import BuiltImage, file_sha256, write_archive, write_layer
from umbra.images.recipes import (
    MIRRORS,
    PYTHON_PREFIX,
    RECIPES,
    SUITE,
    Recipe,
    Rootfs,
)
from umbra.sandbox.render import SERVICE_UID

LOCK_FILE = Path(__file__).parent / "packages.lock"
_PY_SKIP = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "__pycache__", "lib2to3"}


class BuildError(Exception):
    """The build cannot go on; the message says which input or step and why."""


@dataclass(frozen=True)
class Input:
    """One build input: what it is and its SHA-256 (in-toto resolvedDependencies)."""

    uri: str
    sha256: str


@dataclass(frozen=True)
class BuildResult:
    rootfs: Rootfs
    epoch: int
    images: list[BuiltImage]
    inputs: list[Input] = field(default_factory=list)
    lock_policy: LockPolicy = LockPolicy.STRICT
    lock_drift: list[Drift] = field(default_factory=list)


def _run(cmd: list[str], what: str, env: dict[str, str] | None = None, timeout: int = 1800) -> str:
    done = subprocess.run(
        cmd, capture_output=True, text=True, env=env, timeout=timeout, check=False
    )
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
        raise BuildError(f"{what} failed (exit {done.returncode}):\n{tail}")
    return done.stdout


# ---- the package lock -------------------------------------------------------------------------


def read_lock(path: Path = LOCK_FILE) -> dict[Rootfs, dict[str, str]]:
    """`rootfs package version` lines; '#' comments. A malformed line is an error with its line."""
    out: dict[Rootfs, dict[str, str]] = {r: {} for r in Rootfs}
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise BuildError(f"{path}: cannot read the package lock: {exc.strerror}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 3 or parts[0] not in Rootfs.__members__.values():
            raise BuildError(f"{path}:{n}: want 'ROOTFS PACKAGE VERSION', got {line!r}")
        out[Rootfs(parts[0])][parts[1]] = parts[2]
    return out


def write_lock(entries: dict[Rootfs, dict[str, str]], path: Path = LOCK_FILE) -> None:
    lines = ["# Debian packages in each image rootfs, exactly: `umbra image build` refuses others."]
    lines += ["# Regenerate with `umbra image build --update-lock` and review the diff."]
    for rootfs in Rootfs:
        lines += [f"{rootfs} {p} {v}" for p, v in sorted(entries.get(rootfs, {}).items())]
    path.write_text("\n".join(lines) + "\n")


def installed_packages(root: Path) -> dict[str, str]:
    out = _run(
        ["dpkg-query", f"--admindir={root}/var/lib/dpkg", "-W", "-f", "${Package} ${Version}\n"],
        "dpkg-query",
    )
    return dict(line.split(" ", 1) for line in out.splitlines() if line.strip())


def check_lock(
    rootfs: Rootfs,
    got: dict[str, str],
    locked: dict[str, str],
    *,
    policy: LockPolicy = LockPolicy.STRICT,
    root: Path | None = None,
) -> list[Drift]:
    """Refuse (BuildError) what `policy` does not accept (images.lock_policy); return the
    drifts it accepted, each already reported on stderr. `root`: the rootfs, for its apt
    indices (which suite offers a drifted version)."""
    accepted, problems = judge(got, locked, policy=policy, codename=SUITE, origins=origins_in(root))
    if problems:
        raise BuildError(
            f"{rootfs}: installed packages differ from {LOCK_FILE.name} ({policy} policy):\n  "
            + "\n  ".join(problems)
            + "\n(the mirror moved on? review, then `umbra image build --update-lock`)"
        )
    report_drift(accepted)
    return accepted


# ---- steps ------------------------------------------------------------------------------------


def debootstrap(recipe: Recipe, root: Path, epoch: int) -> None:
    env = os.environ | {"SOURCE_DATE_EPOCH": str(epoch), "LC_ALL": "C.UTF-8"}
    _run(
        [
            "mmdebstrap",
            "--mode=root",
            f"--variant={recipe.variant}",
            "--format=directory",
            "--skip=cleanup/apt/cache",
            "--skip=cleanup/apt/lists",
            "--include=" + ",".join(recipe.packages),
            SUITE,
            str(root),
            *MIRRORS,
        ],
        "mmdebstrap",
        env=env,
    )


def deb_inputs(root: Path, installed: dict[str, str]) -> list[Input]:
    """Each installed package's .deb SHA-256, from the signed apt indices the build used."""
    index: dict[tuple[str, str], str] = {}
    for packages in sorted((root / "var/lib/apt/lists").glob("*_Packages")):
        fields: dict[str, str] = {}
        for line in [*packages.read_text(errors="replace").splitlines(), ""]:
            if not line:
                if {"Package", "Version", "SHA256"} <= fields.keys():
                    index[(fields["Package"], fields["Version"])] = fields["SHA256"]
                fields = {}
            elif not line[0].isspace() and ":" in line:
                k, v = line.split(":", 1)
                fields[k] = v.strip()
    missing = [f"{p} {v}" for p, v in sorted(installed.items()) if (p, v) not in index]
    if missing:
        raise BuildError("no apt index entry (SHA256) for: " + ", ".join(missing))
    return [
        Input(f"pkg:deb/debian/{p}@{v}?arch=amd64", index[(p, v)])
        for p, v in sorted(installed.items())
    ]


def copy_python(python_prefix: Path, root: Path) -> None:
    def ignore(_dir: str, names: list[str]) -> set[str]:
        return {n for n in names if n in _PY_SKIP or n.endswith((".pyc", ".a"))}

    dest = root / PYTHON_PREFIX.lstrip("/")
    shutil.copytree(python_prefix, dest, symlinks=True, ignore=ignore)
    shutil.rmtree(dest / "lib/python3.12/site-packages")
    (dest / "lib/python3.12/site-packages").mkdir()
    for script in (dest / "bin").iterdir():  # pyenv's pip/idle scripts point at the host
        if script.name not in ("python3.12", "python3", "python"):
            script.unlink()
    # The host build's rpath names the host prefix: the loader finds libpython through ld.so.conf.
    (root / "etc/ld.so.conf.d/umbra-python.conf").write_text(f"{PYTHON_PREFIX}/lib\n")
    _run(["chroot", str(root), "/sbin/ldconfig"], "ldconfig")


def tree_sha256(path: Path, epoch: int) -> str:
    with open(os.devnull, "wb") as sink:
        digest, _ = write_layer(path, sink, epoch)
    return digest


def install_wheel(wheel: Path, requirements: Path, host_python: Path, root: Path) -> None:
    site = root / PYTHON_PREFIX.lstrip("/") / "lib/python3.12/site-packages"
    env = os.environ | {"UV_COMPILE_BYTECODE": "0", "UV_LINK_MODE": "copy"}
    base = ["uv", "pip", "install", "--quiet", "--python", str(host_python), "--target", str(site)]
    _run([*base, "--require-hashes", "-r", str(requirements)], "uv pip install (locked)", env)
    _run([*base, "--no-deps", str(wheel)], "uv pip install (wheel)", env)
    shutil.rmtree(site / "bin", ignore_errors=True)  # scripts point at the host's interpreter
    for direct_url in site.glob("*.dist-info/direct_url.json"):
        direct_url.unlink()  # names the build's temp path
    launcher = root / PYTHON_PREFIX.lstrip("/") / "bin/umbra"
    launcher.write_text(
        f"#!{PYTHON_PREFIX}/bin/python3.12\nfrom umbra.cli.app import main\n\nmain()\n"
    )
    launcher.chmod(0o755)


def compile_python(root: Path, host_python: Path) -> None:
    """Bytecode for the image's CPython and packages, written once here, after `normalize`. The
    OS root is dm-verity and a container's layers are immutable: nothing at run time can cache
    it, so without it every start of every Umbra process compiled its imports from source (3.5x
    the import time natively and under qemu-user's TCG; per process, tens of seconds of a boot
    under the emulated clouds). Unchecked hash-based pycs: they hold no mtime, and the source
    is not read again at import (each read is hashed by dm-verity), being as immutable and as
    measured as the pyc beside it. Paths are the image's own, and a fixed hash seed orders set
    constants: two builds write the same bytes."""
    prefix = root / PYTHON_PREFIX.lstrip("/")
    _run(
        [str(host_python), "-m", "compileall", "-q", "--invalidation-mode", "unchecked-hash",
         "-s", str(root), "-p", "/", str(prefix / "lib/python3.12")],
        "compileall (image Python)",
        env=os.environ | {"PYTHONHASHSEED": "0"},
    )  # fmt: skip


def normalize(root: Path) -> None:
    """Remove what differs between two runs of the same build, and run-time state."""
    for rel in (
        "var/cache/apt/archives",
        "var/lib/apt/lists",
        "var/log",
        "var/cache/ldconfig",
        "var/cache/debconf",
        "tmp",
        "run",
        "dev",
        "proc",
        "sys",
    ):
        p = root / rel
        if p.exists():
            shutil.rmtree(p)
            p.mkdir(mode=0o1777 if rel == "tmp" else 0o755)
    for pattern in (
        "var/cache/apt/*.bin",
        "etc/ssh/ssh_host_*",
        "var/lib/dpkg/*-old",
        "etc/*-",
        "var/lib/systemd/**",
    ):
        for p in root.glob(pattern):
            if p.is_file() or p.is_symlink():
                p.unlink()
    machine_id = root / "etc/machine-id"
    if machine_id.exists():
        machine_id.write_text("")
    for cache in sorted(root.rglob("__pycache__"), reverse=True):
        shutil.rmtree(cache, ignore_errors=True)


SERVICE_STATE_DIRS = (
    ("var/lib/umbra/policy", 0o700),
    ("var/lib/umbra/spool", 0o700),
    ("var/lib/umbra/mitm-ca", 0o700),
)


def runtime_setup(root: Path) -> None:
    """The services' state directories in the shared runtime rootfs."""
    # The compose's named volumes start as copies of these: the proxy runs as 65534 and keeps
    # its policy, spool and CA there, unreadable by other uids.
    for state, mode in SERVICE_STATE_DIRS:
        path = root / state
        path.mkdir(parents=True, exist_ok=True)
        os.chown(path, SERVICE_UID, SERVICE_UID)
        path.chmod(mode)


@contextmanager
def _workdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="umbra-build-", dir=os.environ.get("UMBRA_BUILD_TMP")))
    try:
        yield d
    finally:
        # An interrupted mmdebstrap leaves /proc, /sys and /dev mounted in the rootfs: never
        # recurse into a live mount.
        with open("/proc/self/mounts") as f:
            mounts = [line.split()[1] for line in f]
        for mnt in sorted((m for m in mounts if m.startswith(f"{d}/")), reverse=True):
            subprocess.run(["umount", "-l", mnt], capture_output=True, check=False)
        shutil.rmtree(d, ignore_errors=True)


def build_rootfs(
    rootfs: Rootfs,
    out: Path,
    *,
    wheel: Path,
    requirements: Path,
    host_python_prefix: Path,
    epoch: int,
    update_lock: bool = False,
    lock_policy: LockPolicy = LockPolicy.STRICT,
    tools: ConsoleTools | None = None,
    without_tools: bool = False,
) -> BuildResult:
    """`tools`: the fetched Pulumi CLI (checked against its pin) and the policy pack, for the
    images whose recipe names them; `without_tools`: a development build without them.
    `lock_policy`: how the rootfs is held to the lock (images.lock_policy; strict for releases)."""
    recipe = RECIPES[rootfs]
    if recipe.tools and tools is None and not without_tools:
        raise BuildError(
            f"{', '.join(sorted(recipe.tools))}: the image carries the Pulumi CLI and the policy "
            "pack; give --pulumi-cli with --pulumi-version/--pulumi-sha256 (the release workflow "
            "fetches it) or --without-tools for a development build"
        )
    out.mkdir(parents=True, exist_ok=True)
    with _workdir() as work:
        root = work / "rootfs"
        debootstrap(recipe, root, epoch)
        got = installed_packages(root)
        lock = read_lock()
        if update_lock:
            lock[rootfs] = got
            write_lock(lock)
        drift = check_lock(rootfs, got, lock[rootfs], policy=lock_policy, root=root)
        inputs = deb_inputs(root, got)
        inputs.append(Input(f"file:{wheel.name}", file_sha256(wheel)))
        inputs.append(
            Input("file:requirements.txt (uv export --frozen)", file_sha256(requirements))
        )
        if recipe.with_python:
            copy_python(host_python_prefix, root)
            py = root / PYTHON_PREFIX.lstrip("/")
            inputs.append(Input("file:cpython-3.12 (build host)", tree_sha256(py, epoch)))
            install_wheel(wheel, requirements, host_python_prefix / "bin/python3.12", root)
        runtime_setup(root)
        normalize(root)
        if recipe.with_python:
            compile_python(root, host_python_prefix / "bin/python3.12")
        layer = work / "layer.tar"
        with layer.open("wb") as f:
            layer_hex, _ = write_layer(root, f, epoch)
        extra: list[tuple[Path, str]] = []
        if recipe.tools and tools is not None:
            extra = [_tools_layer(tools, work, epoch, inputs)]
        images = [
            write_archive(
                name,
                layer,
                layer_hex,
                cfg,
                out / f"{name}.docker.tar",
                epoch,
                extra if name in recipe.tools else (),
            )
            for name, cfg in sorted(recipe.images.items())
        ]
    return BuildResult(rootfs, epoch, images, inputs, lock_policy, drift)


def _tools_layer(
    tools: ConsoleTools, work: Path, epoch: int, inputs: list[Input]
) -> tuple[Path, str]:
    """The tools' own layer (images/console_tools.py), its inputs recorded for provenance."""
    tree = work / "tools"
    try:
        digest = install_console_tools(tools, tree)
    except (ToolError, OSError) as exc:
        raise BuildError(str(exc)) from None
    inputs.append(Input(tools.pin.url, digest))
    inputs.append(Input("file:infra/policy_pack", tree_sha256(tree / "opt/umbra", epoch)))
    path = work / "tools.tar"
    with path.open("wb") as f:
        hex_digest, _ = write_layer(tree, f, epoch)
    return path, hex_digest
