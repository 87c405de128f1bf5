"""The OS image ships the release's image archives where the launch agent's runner loads them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from umbra.images.build import BuildError
from umbra.images.image_store import IMAGES_DIR
from umbra.images.os_image import install_image_archives


def test_archives_land_where_the_runner_loads_them(tmp_path: Path) -> None:
    src = tmp_path / "out"
    src.mkdir()
    for name in ("forwarder", "sshd", "sandbox"):
        (src / f"{name}.docker.tar").write_bytes(name.encode() * 100)
    root = tmp_path / "rootfs"
    placed = install_image_archives(root, sorted(src.glob("*.docker.tar")))
    where = root / "usr/lib/umbra/images"
    assert Path("/usr/lib/umbra/images") == IMAGES_DIR  # `launch-agent --images-dir` default
    assert sorted(p.name for p in where.iterdir()) == [
        "forwarder.docker.tar",
        "sandbox.docker.tar",
        "sshd.docker.tar",
    ]
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in placed)
    assert (where / "sshd.docker.tar").read_bytes() == b"sshd" * 100


@pytest.mark.parametrize(
    ("names", "says"),
    [
        (["sshd.tar"], "named *.docker.tar"),
        (["a/sshd.docker.tar", "b/sshd.docker.tar"], "two image archives with one name"),
        (["missing.docker.tar"], "no such image archive"),
    ],
)
def test_bad_archive_lists_are_refused(tmp_path: Path, names: list[str], says: str) -> None:
    paths = []
    for name in names:
        path = tmp_path / "in" / name
        if name != "missing.docker.tar":
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"x")
        paths.append(path)
    with pytest.raises(BuildError, match=re.escape(says)):
        install_image_archives(tmp_path / "rootfs", paths)
