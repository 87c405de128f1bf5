"""`umbra up`'s client opt-ins (simulated TEE root, SSH identity) apply to its own Console only,
and an explicit environment variable always wins."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from umbra.attest.simpki import SimulatedPki
from umbra.cli import ssh_attest, ssh_config
from umbra.cli.credentials import EmbeddedClient, embedded_client, save_embedded_client
from umbra.cli.ssh_attest import Check, Refused


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    for name in (ssh_attest.SIMULATED_PKI_ENV, ssh_config.IDENTITY_ENV):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def _login(home: Path, url: str) -> None:
    path = home / "config" / "umbra" / "console.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"url": url, "token": "t"}))


def test_opt_ins_apply_only_while_logged_in_to_that_console(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pki = home / "pki"
    SimulatedPki.generate().save(pki)
    save_embedded_client(
        EmbeddedClient(
            console_url="http://127.0.0.1:7081",
            simulated_pki=str(pki),
            ssh_identity=str(home / "id_ed25519"),
        )
    )
    assert (home / "config" / "umbra" / "embedded.json").stat().st_mode & 0o077 == 0
    _login(home, "http://127.0.0.1:7081")
    assert embedded_client() is not None
    _, root = ssh_attest.collateral_and_root(simulated=True)
    assert root == SimulatedPki.load(pki).root_der
    assert ("IdentityFile", str(home / "id_ed25519")) in ssh_config.options("cvm_x", reuse=False)

    _login(home, "https://console.example.com")  # another Console: no simulated TEE, no key
    assert embedded_client() is None
    with pytest.raises(Refused) as refused:
        ssh_attest.collateral_and_root(simulated=True)
    assert refused.value.check == Check.simulated
    assert not any(k == "IdentityFile" for k, _ in ssh_config.options("cvm_x", reuse=False))

    monkeypatch.setenv(ssh_config.IDENTITY_ENV, str(home / "other"))  # the environment wins
    _login(home, "http://127.0.0.1:7081")
    assert ("IdentityFile", str(home / "other")) in ssh_config.options("cvm_x", reuse=False)
