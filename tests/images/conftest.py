"""Build inputs shared by the image build tests: the project's wheel and its locked requirements,
made once per session (uv build --wheel; uv export --frozen)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


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
