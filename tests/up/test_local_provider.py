"""The local provider's failure paths: a CVM that cannot be provisioned is refused with its
reason, leaves nothing behind, never reports running, and never touches what is not its own."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.console import enroll
from tests.console.helpers import new_team, start_server
from tests.console.oidc_issuer import LocalIssuer
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx
from umbra.console.providers import CvmSpec, ProviderError
from umbra.console.providers_local import LocalCvmProvider, LocalCvmSettings
from umbra.contracts.session import CVM_ID_EVENT
from umbra.policy.bundle import generate_key


def _need_root() -> None:
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("nft") is None:
        pytest.skip("needs root, iproute2 and nftables (CI has them)")


def _provider(tmp_path: Path, prefix: str, pki_dir: Path, console_url: str) -> LocalCvmProvider:
    return LocalCvmProvider(
        LocalCvmSettings(
            runtime_dir=tmp_path, name_prefix=prefix, security_cvm_port=9,
            security_cvm_release=SimulatedTdx(enroll.pki(), image=enroll.SECURITY_IMAGE)
            .release_manifest().model_dump(mode="json", exclude_none=True),
            collateral_file=tmp_path / "c.json", simulated_root=tmp_path / "root.der",
            console_url=console_url,
            simulated_pki=pki_dir,
        )
    )  # fmt: skip


def test_a_launch_that_cannot_be_provisioned_fails_with_its_reason(tmp_path: Path) -> None:
    _need_root()
    prefix = f"u11a{os.getpid() % 10000}"
    provider = _provider(tmp_path, prefix, tmp_path / "pki", "http://127.0.0.1:9")
    spec = CvmSpec(
        id="cvm_00aa11bb22cc33dd", team="t", name="d", kind="dev", owner="o",
        enrollment_token="enr_" + "x" * 40,
    )  # fmt: skip
    squatter = f"{prefix}-00aa11bb-sbx"  # someone else's namespace with the name we would use
    subprocess.run(["ip", "netns", "add", squatter], check=True)
    try:
        with pytest.raises(ProviderError, match="already exists"):
            provider.launch(spec, lambda event: None)
        assert Path("/run/netns", squatter).exists(), "a namespace not ours was deleted"
        assert not (tmp_path / "cvms" / spec.id).exists()
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        assert prefix not in links
    finally:
        subprocess.run(["ip", "netns", "del", squatter], check=False)


def test_a_dev_cvm_whose_enrollment_is_refused_fails_and_never_runs(tmp_path: Path) -> None:
    """Through the Console: the CVM's simulated TD is signed by another root than the Console
    trusts, so enrollment is refused; the launch fails with that reason and nothing is left."""
    _need_root()
    prefix = f"u11b{os.getpid() % 10000}"
    issuer = LocalIssuer()
    db = tmp_path / "console.db"
    server = start_server("sqlite", f"sqlite:///{db}", db, issuer.url, generate_key(), tmp_path)
    try:
        server.console.enrollment_verifiers["dev"] = enroll.verifier(
            enroll.DEV_IMAGE, events=[{"name": CVM_ID_EVENT}]
        )
        SimulatedPki.generate().save(tmp_path / "impostor-pki")
        provider = _provider(tmp_path, prefix, tmp_path / "impostor-pki", server.url)
        server.console.providers["local"] = provider
        team = new_team(server, issuer)
        try:
            created = team.dev.post(
                f"/api/v1/teams/{team.name}/cvms",
                json={"name": "impostor", "security_cvm_id": team.scvm_id},
            )
            assert created.status_code == 201, created.text
            assert created.json()["state"] == "launching"
            cvm_id = created.json()["id"]
            end, state = time.monotonic() + 60, created.json()
            while state["state"] == "launching" and time.monotonic() < end:
                time.sleep(0.2)
                state = team.dev.get(f"/api/v1/cvms/{cvm_id}").json()
            assert state["state"] == "failed", state
            assert "enrollment" in state["state_reason"]
            assert "attestation_failed" in state["state_reason"]
            assert not (tmp_path / "cvms" / cvm_id).exists(), "a failed launch left files"
            links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
            assert prefix not in links
            audit = team.admin.get(f"/api/v1/teams/{team.name}/audit").json()
            entries = audit["entries"] if isinstance(audit, dict) else audit
            refused = [e for e in entries if e["action"] == "cvm.enroll_refused"]
            assert refused and refused[0]["details"]["reason"] == "attestation_failed"
        finally:
            team.close()
    finally:
        server.stop()
        issuer.close()
