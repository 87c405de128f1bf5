"""A Dev CVM's forwarder enrolls at the real Console (SQLite) with the emulated clouds' TEE: quotes
of the host's TDX module (umbra.emulated.tdx_module) over the guest's port, with the event log
the launch agent wrote (the module's CCEL, then RTMR3's events), as `--tee emulated` does in a VM.
A reboot is a fresh TD (RTMR3 from zero) and loses the credential (tmpfs): the launch agent
measures the same launch again and the forwarder re-enrolls by a fresh quote, no new token.

No VM: the port is a pty relayed to the module (tests/emulated/port_relay.py); the boot in
QEMU is tests/images/test_emulated_walkthrough.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.console import enroll
from tests.console.helpers import Server, new_team
from tests.console.oidc_issuer import LocalIssuer
from tests.emulated.port_relay import port_to
from tests.sandbox.fixtures import dev_definition
from umbra.attest import tdx_port
from umbra.attest.eventlog import dump_dstack_event_log, make_runtime_event
from umbra.attest.tdx_port import TdxModulePort
from umbra.contracts.session import CVM_ID_EVENT
from umbra.emulated.tdx_module import TdxModule
from umbra.images.launch_agent import TdxModuleRtmr
from umbra.proxy.identity import hash_credential
from umbra.sandbox.dev_definition import render_dev_host
from umbra.sandbox.forwarder_config import ForwarderConfig, ForwarderConfigError
from umbra.sandbox.forwarder_enroll import ensure_tunnel_credential

from .test_enrollment import _audit_actions, console

__all__ = ["console"]  # the module Console fixture, shared with test_enrollment


def _measure(port: Path, launch: Path, cvm_id: str) -> None:
    """The launch agent's part (`--tee emulated`): extend through the port, then write the
    module's CCEL and the events as the forwarder's event log."""
    rtmr = TdxModuleRtmr(TdxModulePort(port))
    events = [make_runtime_event(3, CVM_ID_EVENT, cvm_id.encode())]
    for event in events:
        rtmr.extend(event)
    log = [*rtmr.firmware_events(), *events]
    (launch / "event-log.json").write_text(dump_dstack_event_log(log))


def test_the_forwarder_enrolls_with_module_quotes_and_reenrolls_after_a_reboot(
    console: tuple[Server, LocalIssuer], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server, issuer = console
    team = new_team(server, issuer)
    verifiers = server.console.enrollment_verifiers
    plain = verifiers["dev"]
    verifiers["dev"] = enroll.verifier(enroll.DEV_IMAGE, events=[{"name": CVM_ID_EVENT}])
    module = TdxModule(tmp_path / "tdx.sock", enroll.pki(), enroll.DEV_IMAGE)
    try:
        dev_cvm = team.dev_cvm()
        port = server.url.rsplit(":", 1)[1].split("/")[0]
        text = render_dev_host(dev_definition(console_url=f"https://console.test:{port}").host)
        doc = json.loads(text.text)["forwarder"]
        launch, state = tmp_path / "launch", tmp_path / "state"
        launch.mkdir()
        (launch / "cvm-id").write_text(dev_cvm + "\n")
        minted = team.admin.post(f"/api/v1/cvms/{dev_cvm}/enrollment-token")
        assert minted.status_code == 201, minted.text
        token = str(minted.json()["token"])
        (launch / "enrollment-token").write_text(token + "\n")
        (launch / "console-ips").write_text("127.0.0.1\n")
        doc["cvm_id_file"] = str(launch / "cvm-id")
        doc["credential_file"] = str(state / "tunnel-credential")
        doc["enrollment"] |= {
            "console_url": f"http://console.test:{port}",
            "token_file": str(launch / "enrollment-token"),
            "console_ips_file": str(launch / "console-ips"),
            "quote_source": "emulated",
            "event_log": str(launch / "event-log.json"),
        }
        cfg = ForwarderConfig.model_validate(doc)
        with module.serving():
            with port_to(module) as device:  # boot 1
                monkeypatch.setattr(tdx_port, "TDX_PORT", device)  # the guest's device path
                _measure(device, launch, dev_cvm)
                assert ensure_tunnel_credential(cfg) is True
            credential = (state / "tunnel-credential").read_text().strip()
            attached = team.scvm.get(f"/api/v1/security-cvms/{team.scvm_id}/attachments").json()
            assert attached["cvms"][dev_cvm]["credential_sha256"] == hash_credential(credential)
            assert module.requests == ["extend", "ccel", "quote"]
            # Reboot: a fresh TD, the credential gone with tmpfs, the same launch data (and
            # spent token) written again; the forwarder re-enrolls by a fresh quote.
            (state / "tunnel-credential").unlink()
            audited = len(_audit_actions(team))
            with port_to(module) as device:  # boot 2
                monkeypatch.setattr(tdx_port, "TDX_PORT", device)
                _measure(device, launch, dev_cvm)
                assert ensure_tunnel_credential(cfg) is True
            assert len(module.boots) == 2
            renewed = (state / "tunnel-credential").read_text().strip()
            assert renewed.startswith("umbra_tun_") and renewed != credential
            attached = team.scvm.get(f"/api/v1/security-cvms/{team.scvm_id}/attachments").json()
            assert attached["cvms"][dev_cvm]["credential_sha256"] == hash_credential(renewed)
            assert [a for a, _ in _audit_actions(team)[audited:]] == ["cvm.reenroll"]
            # A quote whose log does not match its TD (boot 3 measures nothing): refused.
            (state / "tunnel-credential").unlink()
            with port_to(module) as device:
                monkeypatch.setattr(tdx_port, "TDX_PORT", device)
                with pytest.raises(ForwarderConfigError, match="attestation_failed"):
                    ensure_tunnel_credential(cfg)
            assert not (state / "tunnel-credential").exists()
    finally:
        verifiers["dev"] = plain
        team.close()
