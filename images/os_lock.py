"""The OS images' package lock (images/os/packages.lock): every Debian package each OS definition
installs, at its exact version. `umbra image os-build` refuses a rootfs that differs in any
package (a mirror that moved on, a new dependency, a package gone), naming each difference;
`--update-lock` rewrites the definition's lines from the build, for review in the diff. The test
suite's builds hold the rootfs to the lock under images.lock_policy's `security-updates` policy.

Lines are `DEFINITION PACKAGE VERSION`, the definition being the file's stem (`gcp` for
images/os/gcp.yaml); `#` comments. The container images' lock is images/packages.lock
(images.build), one per kind of image: the OS images come from trixie (+ backports' kernel),
the containers from bookworm.
"""

from __future__ import annotations

import re
from pathlib import Path

from umbra.images.build import BuildError
from umbra.images.lock_policy import Drift, LockPolicy, judge, origins_in, report_drift

# The OS image's suite, not the container images' (recipes.SUITE): bookworm's 6.1 kernel has no
# TDX guest support (`# CONFIG_INTEL_TDX_GUEST is not set`), trixie's 6.12 lacks
# TSM_MEASUREMENTS (the RTMR3 sysfs files the launch agent writes). The kernel comes from
# trixie-backports, named by exact version in each definition; everything else from trixie.
OS_SUITE = "trixie"
OS_LOCK_FILE = Path(__file__).parent / "os" / "packages.lock"
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")
HEADER = (
    "# Debian packages in each OS image rootfs, exactly: `umbra image os-build` refuses others.\n"
    "# Regenerate with `umbra image os-build DEFINITION --update-lock …` and review the diff.\n"
)


def read_os_lock(path: Path = OS_LOCK_FILE) -> dict[str, dict[str, str]]:
    """definition -> package -> version. A malformed line is an error naming file and line."""
    out: dict[str, dict[str, str]] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise BuildError(f"{path}: cannot read the OS package lock: {exc.strerror}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 3 or not _NAME.match(parts[0]):
            raise BuildError(f"{path}:{n}: want 'DEFINITION PACKAGE VERSION', got {line!r}")
        name, package, version = parts
        if package in out.setdefault(name, {}):
            raise BuildError(f"{path}:{n}: {name} {package} is locked twice")
        out[name][package] = version
    return out


def write_os_lock(entries: dict[str, dict[str, str]], path: Path = OS_LOCK_FILE) -> None:
    lines = [
        f"{name} {p} {v}" for name in sorted(entries) for p, v in sorted(entries[name].items())
    ]
    path.write_text(HEADER + "\n".join(lines) + "\n")


def check_os_lock(
    name: str,
    got: dict[str, str],
    lock: dict[str, dict[str, str]],
    *,
    policy: LockPolicy = LockPolicy.STRICT,
    root: Path | None = None,
) -> list[Drift]:
    """Refuse (BuildError) a rootfs whose packages differ from the lock's for `name` in a way
    `policy` does not accept; return (and report) the accepted drifts. `root`: the rootfs, for
    its apt indices."""
    locked = lock.get(name)
    if not locked:
        raise BuildError(
            f"{name}: no packages locked for this OS definition in {OS_LOCK_FILE.name} "
            "(build once with --update-lock and review the diff)"
        )
    accepted, problems = judge(
        got, locked, policy=policy, codename=OS_SUITE, origins=origins_in(root)
    )
    if problems:
        raise BuildError(
            f"{name}: installed packages differ from images/os/{OS_LOCK_FILE.name} "
            f"({policy} policy):\n  "
            + "\n  ".join(problems)
            + "\n(the mirror moved on? review, then `umbra image os-build … --update-lock`)"
        )
    report_drift(accepted)
    return accepted


def lock_os_packages(
    name: str,
    got: dict[str, str],
    *,
    update: bool,
    policy: LockPolicy = LockPolicy.STRICT,
    root: Path | None = None,
    path: Path = OS_LOCK_FILE,
) -> list[Drift]:
    """The build's step: with `update`, replace `name`'s lines by `got` (others kept); then
    check under `policy`, returning the accepted drifts."""
    lock = read_os_lock(path)
    if update:
        lock[name] = dict(got)
        write_os_lock(lock, path)
    return check_os_lock(name, got, lock, policy=policy, root=root)
