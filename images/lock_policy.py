"""How a build holds its rootfs to a package lock (images/packages.lock, images/os/packages.lock).

`strict` (release builds, the default): every installed package at exactly the locked version.
`security-updates` (the test suite's builds): the same, except that a package may be at a *newer*
version (dpkg's ordering) when that version is offered by the build's own codename, its
`-updates` or its `-security` suite: a Debian security or point update of the locked package set.
The suite is read from the apt indices the build used (the rootfs's var/lib/apt/lists): the
`Codename:` of each `InRelease`/`Release` file (apt checked its signature during mmdebstrap) and
the versions its `Packages` index lists. A new or missing package, a downgrade, or a version only
another suite offers (backports, another codename) is refused as in `strict`. Each accepted
drift is returned for the build to print and record; nothing is accepted silently.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

# (package, version) -> the codenames whose apt index lists that version.
Origins = Mapping[tuple[str, str], frozenset[str]]


class LockPolicy(StrEnum):
    STRICT = "strict"
    SECURITY_UPDATES = "security-updates"


@dataclass(frozen=True)
class Drift:
    """A package installed at another version than the lock's, accepted by the policy."""

    package: str
    locked: str
    installed: str
    suite: str

    def line(self) -> str:
        return (
            f"lock drift accepted: {self.package} {self.locked} -> {self.installed} "
            f"({self.suite}); refresh the lock with --update-lock"
        )


def update_suites(codename: str) -> tuple[str, str, str]:
    """The suites whose newer versions `security-updates` accepts, preferred first."""
    return (f"{codename}-security", f"{codename}-updates", codename)


def newer(installed: str, locked: str) -> bool | None:
    """`installed` > `locked` in Debian's version ordering (dpkg --compare-versions); None
    without dpkg (the build host has it: mmdebstrap needs it)."""
    dpkg = shutil.which("dpkg")
    if dpkg is None:
        return None
    done = subprocess.run(
        [dpkg, "--compare-versions", installed, "gt", locked], capture_output=True, check=False
    )
    return done.returncode == 0


def judge(
    got: Mapping[str, str],
    locked: Mapping[str, str],
    *,
    policy: LockPolicy,
    codename: str,
    origins: Callable[[set[tuple[str, str]]], Origins],
) -> tuple[list[Drift], list[str]]:
    """(accepted drifts, refused differences: one line each). `origins` is asked only when the
    policy has a version difference to weigh, for exactly those (package, version) pairs."""
    problems: dict[str, str] = {}  # package -> its line; reported in package order
    changed: list[str] = []
    for p in sorted(set(locked) | set(got)):
        if p not in got:
            problems[p] = f"{p}: locked {locked[p]}, not installed"
        elif p not in locked:
            problems[p] = f"{p}: {got[p]} installed but not in the lock"
        elif got[p] != locked[p]:
            changed.append(p)
    accepted: list[Drift] = []
    strict = policy is LockPolicy.STRICT
    found = origins({(p, got[p]) for p in changed}) if changed and not strict else {}
    allowed = update_suites(codename)
    for p in changed:
        head = f"{p}: locked {locked[p]}, got {got[p]}"
        if strict:
            problems[p] = head
            continue
        suites = found.get((p, got[p]), frozenset())
        suite = next((s for s in allowed if s in suites), None)
        is_newer = newer(got[p], locked[p])
        if is_newer is None:
            problems[p] = f"{head} (no dpkg on this host to compare the versions)"
        elif not is_newer:
            problems[p] = f"{head} (not newer than the lock: a downgrade is never accepted)"
        elif suite is None:
            offered = ", ".join(sorted(suites)) or "no apt index of this build"
            problems[p] = f"{head} (from {offered}, not {' / '.join(allowed)})"
        else:
            accepted.append(Drift(p, locked[p], got[p], suite))
    return accepted, [problems[p] for p in sorted(problems)]


def _codename(release: Path) -> str | None:
    for line in release.read_text(errors="replace").splitlines():
        if line.startswith("Codename:"):
            return line.split(":", 1)[1].strip()
        if line.startswith(("MD5Sum:", "SHA256:", "-----BEGIN PGP SIGNATURE")):
            break
    return None


def apt_origins(root: Path, wanted: set[tuple[str, str]]) -> Origins:
    """For each wanted (package, version): the codenames of the rootfs's apt indices listing it.
    A `…_dists_D_main_binary-amd64_Packages` index belongs to the `…_dists_D_InRelease` (or
    `Release`) file whose name, less that suffix, is the longest prefix of the index's name."""
    lists = root / "var/lib/apt/lists"
    releases: dict[str, str] = {}
    for suffix in ("Release", "InRelease"):
        for f in lists.glob(f"*_{suffix}"):
            codename = _codename(f)
            if codename:
                releases[f.name[: -len(suffix)]] = codename
    out: dict[tuple[str, str], set[str]] = {}
    for index in sorted(lists.glob("*_Packages")):
        prefixes = [pre for pre in releases if index.name.startswith(pre)]
        if not prefixes:
            continue  # an index without a Release file: no suite to vouch for it
        codename = releases[max(prefixes, key=len)]
        package = ""
        for line in index.read_text(errors="replace").splitlines():
            if line.startswith("Package:"):
                package = line.split(":", 1)[1].strip()
            elif line.startswith("Version:"):
                key = (package, line.split(":", 1)[1].strip())
                if key in wanted:
                    out.setdefault(key, set()).add(codename)
    return {k: frozenset(v) for k, v in out.items()}


def origins_in(root: Path | None) -> Callable[[set[tuple[str, str]]], Origins]:
    """`judge`'s `origins` for a build's rootfs (none without one: every drift is refused)."""
    return lambda wanted: apt_origins(root, wanted) if root is not None else {}


def report_drift(accepted: list[Drift]) -> None:
    """Loudly: a build that accepted drift says so on stderr, one line per package."""
    for d in accepted:
        print(d.line(), file=sys.stderr)
