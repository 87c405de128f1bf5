"""Fixtures: a real Console (SQLite) and OIDC issuer, a simulated PKI, a developer's client home."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.console.helpers import Server, start_server, unique
from tests.console.oidc_issuer import LocalIssuer
from tests.session import harness
from umbra.console.models import Cvm
from umbra.policy.bundle import generate_key


@pytest.fixture(scope="session")
def console(issuer: LocalIssuer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("console")
    db = tmp / "console.db"
    server = start_server("sqlite", f"sqlite:///{db}", db, issuer.url, generate_key(), tmp)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def pki_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return harness.simulated_pki(tmp_path_factory.mktemp("pki") / "pki")


@dataclass
class Developer:
    """One developer's laptop: HOME, config dir, SSH key, Console login."""

    home: Path
    key: Path
    pub: str
    token: str
    team: str
    env: dict[str, str]
    console: Server
    cvms: list[str] = field(default_factory=list)

    def create_cvm(self, name: str, keys: list[str] | None = None) -> str:
        with self.console.client(self.token) as http:
            resp = http.post(
                f"/api/v1/teams/{self.team}/cvms",
                json={"name": name, "ssh_keys": keys if keys is not None else [self.pub]},
            )
            assert resp.status_code == 201, resp.text
            cvm_id = str(resp.json()["id"])
        self.cvms.append(cvm_id)
        return cvm_id

    def record(self, cvm_id: str, *, port: int, release: dict[str, Any], **fields: Any) -> None:
        """What the provider records at launch: the ingress address and the release manifest."""
        with self.console.console.write() as session:
            cvm = session.get(Cvm, cvm_id)
            assert cvm is not None
            cvm.provider_state = {
                "ssh_ingress": {"host": "127.0.0.1", "port": port},
                "release_manifest": release,
            }
            for key, value in fields.items():
                setattr(cvm, key, value)

    def umbra(self, *args: str, timeout: float = 60, **kw: Any) -> subprocess.CompletedProcess[str]:
        exe = str(Path(sys.executable).parent / "umbra")
        return subprocess.run(
            [exe, *args], capture_output=True, text=True, env=self.env, timeout=timeout, **kw
        )


def make_developer(
    console: Server, issuer: LocalIssuer, pki_dir: Path, tmp_path: Path
) -> Developer:
    team = unique("team")
    subject = unique("dev")
    token = issuer.token(subject, [f"{team}:developer"])
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    key, pub = harness.keypair(home / ".ssh")
    config = home / ".config"
    (config / "umbra").mkdir(parents=True, mode=0o700)
    (config / "umbra" / "console.json").write_text(
        json.dumps({"url": console.url, "token": token, "team": team})
    )
    tmpdir = tmp_path / "t"
    tmpdir.mkdir()
    env = {
        **os.environ,
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(config),
        "TMPDIR": str(tmpdir),
        "UMBRA_SIMULATED_PKI": str(pki_dir),
        "UMBRA_SSH_IDENTITY": str(key),
    }
    return Developer(home, key, pub, token, team, env, console)


@pytest.fixture(scope="module")
def developer(
    console: Server, issuer: LocalIssuer, pki_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Developer]:
    dev = make_developer(console, issuer, pki_dir, tmp_path_factory.mktemp("dev"))
    try:
        yield dev
    finally:
        harness.stop_agents(Path(dev.env["TMPDIR"]))
