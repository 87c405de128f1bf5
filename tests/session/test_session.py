"""The developer's session path end to end: real OpenSSH client and gateway sshd, a sandbox in
its own user/network/pid namespaces, aTLS to a simulated TD, and a real Console."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.session import harness
from tests.session.conftest import Developer

pytestmark = pytest.mark.usefixtures("tools")


@pytest.fixture(scope="module")
def tools() -> None:
    harness.require_tools()


@pytest.fixture
def box() -> Iterator[harness.Sandbox]:
    with harness.sandbox() as sandbox:
        yield sandbox


@pytest.fixture
def cvm(developer: Developer, box: harness.Sandbox, pki_dir: Path, tmp_path: Path) -> Iterator[tuple[str, harness.IngressProc]]:
    cvm_id = developer.create_cvm(harness.unique_name())
    work = tmp_path / "cvm"
    work.mkdir()
    with harness.ingress(box, work, cvm_id, [developer.pub], pki_dir) as ing:
        developer.record(cvm_id, port=ing.port, release=harness.release_manifest())
        yield cvm_id, ing


def test_umbra_ssh_runs_a_command_in_the_sandbox(developer: Developer, cvm: tuple[str, harness.IngressProc], box: harness.Sandbox) -> None:
    cvm_id, _ = cvm
    done = developer.umbra("ssh", cvm_id, "--no-reuse", "--", "id -u; pwd")
    assert done.returncode == 0, done.stderr
    uid, cwd = done.stdout.split()
    assert uid == "1000" and cwd == str(box.home)
    known = (developer.home / ".config/umbra/ssh/known_hosts").read_text()
    host_pub = (cvm[1].state_dir / "ssh_host_ed25519_key.pub").read_text().split()[:2]
    assert known == f"umbra-{cvm_id} {' '.join(host_pub)}\n"
