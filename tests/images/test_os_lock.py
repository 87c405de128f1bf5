"""The OS images' package lock (images/os/packages.lock, images.os_lock): fast checks of the
committed lock against the definitions, and of the build's refusal on drift. The builds that
check it for real are the boot tests' (`qemu`) and the release workflow's (`gcp`, `azure`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from umbra.images.build import BuildError
from umbra.images.os_image import OS_DIR, _packages, load_os_definition
from umbra.images.os_lock import (
    OS_LOCK_FILE,
    check_os_lock,
    lock_os_packages,
    read_os_lock,
    write_os_lock,
)

DEFINITIONS = sorted(p.stem for p in OS_DIR.glob("*.yaml"))


def test_every_os_definition_is_locked_with_what_it_asks_for() -> None:
    lock = read_os_lock()
    assert sorted(lock) == DEFINITIONS
    for name in DEFINITIONS:
        d = load_os_definition(OS_DIR / f"{name}.yaml")
        assert d.cloud == name  # the lock is keyed by the definition's cloud
        for requested in _packages(d):
            package = requested.split("/")[0]  # `linux-base/trixie-backports`: by release
            assert package in lock[name], f"{name}: {package} is not locked"
        # The kernel is the backports' TDX guest kernel, and the lock holds its exact build.
        assert lock[name][d.kernel].startswith("7.3.4-"), lock[name][d.kernel]


def test_the_build_refuses_a_rootfs_that_drifted_from_the_lock() -> None:
    lock = {"qemu": {"bash": "5.2.37-2", "systemd": "257.9-1~deb13u1"}}
    check_os_lock("qemu", {"bash": "5.2.37-2", "systemd": "257.9-1~deb13u1"}, lock)
    drifted = {"bash": "5.2.37-2+b1", "tini": "0.19.0-1"}
    with pytest.raises(BuildError) as caught:
        check_os_lock("qemu", drifted, lock)
    message = str(caught.value)
    assert "bash: locked 5.2.37-2, got 5.2.37-2+b1" in message
    assert "systemd: locked 257.9-1~deb13u1, not installed" in message
    assert "tini: 0.19.0-1 installed but not in the lock" in message
    assert "--update-lock" in message


def test_a_definition_without_locked_packages_is_refused() -> None:
    with pytest.raises(BuildError, match=r"gcp: no packages locked"):
        check_os_lock("gcp", {"bash": "5.2.37-2"}, {"qemu": {"bash": "5.2.37-2"}})


def test_update_rewrites_one_definition_and_keeps_the_others(tmp_path: Path) -> None:
    path = tmp_path / "packages.lock"
    write_os_lock({"gcp": {"bash": "1"}, "qemu": {"bash": "1", "tini": "2"}}, path)
    lock_os_packages("qemu", {"bash": "3"}, update=True, path=path)
    assert read_os_lock(path) == {"gcp": {"bash": "1"}, "qemu": {"bash": "3"}}
    with pytest.raises(BuildError, match="bash: locked 3, got 4"):
        lock_os_packages("qemu", {"bash": "4"}, update=False, path=path)
    assert read_os_lock(path)["qemu"] == {"bash": "3"}  # a refused build writes nothing


@pytest.mark.parametrize(
    ("line", "want"),
    [
        ("qemu bash", r":3: want 'DEFINITION PACKAGE VERSION', got 'qemu bash'"),
        ("Qemu bash 1", r":3: want 'DEFINITION PACKAGE VERSION'"),
        ("qemu tini 1", r":3: qemu tini is locked twice"),
    ],
)
def test_a_malformed_lock_line_is_named_by_file_and_line(
    tmp_path: Path, line: str, want: str
) -> None:
    path = tmp_path / "packages.lock"
    path.write_text(f"# comment\nqemu tini 0.19.0-1\n{line}\n")
    with pytest.raises(BuildError, match=want):
        read_os_lock(path)


def test_the_lock_file_is_where_the_build_reads_it() -> None:
    assert OS_LOCK_FILE == OS_DIR / "packages.lock"
