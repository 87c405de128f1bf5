"""Enrollment from tests: a simulated TD of the right release trades a one-time token for its
CVM's credential through the real routes (no credential is ever handed out any other way).

`install` gives a test Console one verifier per CVM kind on a shared simulated PKI;
`security_credential` enrolls a Security CVM as its proxy would (attest/enroll_client.py).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx

from umbra.attest.collateral import StaticCollateral
from umbra.attest.enroll_client import ensure_credential
from umbra.attest.measurement import MeasurementPolicy, ReleaseManifest
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx
from umbra.attest.verify import Verifier
from umbra.console.release import AttestedReleaseVerifier
from umbra.console.state import Console

SECURITY_IMAGE = "umbra-security-cvm"
DEV_IMAGE = "umbra-dev-cvm"
_lock = threading.Lock()
_pki: list[SimulatedPki] = []


def pki() -> SimulatedPki:
    with _lock:
        if not _pki:
            _pki.append(SimulatedPki.generate())
        return _pki[0]


def verifier(
    image: str, root: SimulatedPki | None = None, **release_extra: object
) -> AttestedReleaseVerifier:
    root = root or pki()
    return release_verifier(SimulatedTdx(root, image=image).release_manifest(**release_extra), root)


def release_verifier(release: ReleaseManifest, root: SimulatedPki) -> AttestedReleaseVerifier:
    """The Console's verifier for `release`, whose simulated quotes chain to `root`."""
    return AttestedReleaseVerifier(
        Verifier(
            MeasurementPolicy(release=release),
            StaticCollateral(root.collateral(int(time.time()) - 3600)),
            allow_simulated=True,
            simulated_root_der=root.root_der,
        )
    )


def install(console: Console) -> None:
    """Per-release enrollment for a test Console (unless its settings configured one)."""
    if not console.enrollment_verifiers:
        console.enrollment_verifiers = {
            "security": verifier(SECURITY_IMAGE),
            "dev": verifier(DEV_IMAGE),
        }


def enroll(
    url: str, admin: httpx.Client, cvm_id: str, image: str, tmp: Path, *, token: str | None = None
) -> str:
    """Mint a token (as an admin) and enroll `cvm_id` as a simulated TD of `image` would."""
    if token is None:
        minted = admin.post(f"/api/v1/cvms/{cvm_id}/enrollment-token")
        assert minted.status_code == 201, minted.text
        token = str(minted.json()["token"])
    token_file = tmp / f"{cvm_id}.token"
    token_file.write_text(token)
    td = SimulatedTdx(pki(), image=image)
    credential, enrolled = ensure_credential(
        console_url=url,
        cvm_id=cvm_id,
        token_file=token_file,
        credential_file=tmp / f"{cvm_id}.credential",
        quoter=lambda rd: (td.quote(rd), None),
    )
    assert enrolled
    return credential


def security_credential(url: str, admin: httpx.Client, cvm_id: str, tmp: Path) -> str:
    return enroll(url, admin, cvm_id, SECURITY_IMAGE, tmp)
