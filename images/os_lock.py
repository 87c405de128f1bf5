"""The OS images' package lock (images/os/packages.lock): every Debian package each OS definition
installs, at its exact version. `umbra image os-build` refuses a rootfs that differs in any
package (a mirror that moved on, a new dependency, a package gone), naming each difference;
`--update-lock` rewrites the definition's lines from the build, for review in the diff.

Lines are `DEFINITION PACKAGE VERSION`, the definition being the file's stem (`gcp` for
images/os/gcp.yaml); `#` comments. The container images' lock is images/packages.lock
(images.build), one per kind of image: the OS images come from trixie (+ backports' kernel),
the containers from bookworm.
"""

from __future__ import annotations

import re
from pathlib import Path

from umbra.images.build import BuildError, package_drift

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


def check_os_lock(name: str, got: dict[str, str], lock: dict[str, dict[str, str]]) -> None:
    """Refuse (BuildError) a rootfs whose packages differ from the lock's for `name`."""
    locked = lock.get(name)
    if not locked:
        raise BuildError(
            f"{name}: no packages locked for this OS definition in {OS_LOCK_FILE.name} "
            "(build once with --update-lock and review the diff)"
        )
    problems = package_drift(got, locked)
    if problems:
        raise BuildError(
            f"{name}: installed packages differ from images/os/{OS_LOCK_FILE.name}:\n  "
            + "\n  ".join(problems)
            + "\n(the mirror moved on? review, then `umbra image os-build … --update-lock`)"
        )


def lock_os_packages(
    name: str, got: dict[str, str], *, update: bool, path: Path = OS_LOCK_FILE
) -> None:
    """The build's step: with `update`, replace `name`'s lines by `got` (others kept); then
    check."""
    lock = read_os_lock(path)
    if update:
        lock[name] = dict(got)
        write_os_lock(lock, path)
    check_os_lock(name, got, lock)
