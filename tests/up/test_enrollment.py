"""Credentials only after attestation, against the real Console (SQLite) and simulated TDs.

Each CVM kind enrolls against its own release (tests/console/enroll.py gives the Console one
verifier per kind): a Security CVM gets its Console credential, a Dev CVM its tunnel credential,
each HPKE-sealed to a key its TD generated. A reused token, a quote of another release (including
the other kind's), or a quote binding another key are refused and audited and issue nothing; a
never-enrolled CVM whose enrollment is refused fails with the reason instead of reporting running.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from tests.console import enroll
from tests.console.helpers import Server, new_team, start_server
from tests.console.oidc_issuer import LocalIssuer
from tests.sandbox.fixtures import dev_definition
from umbra.attest.enroll_client import EnrollError, ensure_credential
from umbra.attest.eventlog import dump_dstack_event_log
from umbra.attest.measurement import SSH_KEYS_EVENT, ssh_keys_digest
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx
from umbra.console.enrollment import hpke_info, report_data
from umbra.console.models import Cvm
from umbra.console.session_info import EVENTS_KEY
from umbra.contracts.release import SUITE
from umbra.contracts.session import CVM_ID_EVENT, HOST_FIREWALL_EVENT
from umbra.policy.bundle import generate_key
from umbra.proxy.identity import hash_credential
from umbra.sandbox.dev_definition import render_dev_host
from umbra.sandbox.forwarder_config import ForwarderConfig
from umbra.sandbox.forwarder_enroll import ensure_tunnel_credential


@pytest.fixture(scope="module")
def console(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, LocalIssuer]]:
    issuer = LocalIssuer()
    tmp = tmp_path_factory.mktemp("enroll")
    db = tmp / "console.db"
    server = start_server("sqlite", f"sqlite:///{db}", db, issuer.url, generate_key(), tmp)
    yield server, issuer
    server.stop()
    issuer.close()


def _evidence(
    server: Server, token: str, cvm_id: str, td: SimulatedTdx, *, bind_other_key: bool = False
) -> tuple[dict[str, Any], X25519PrivateKey]:
    with server.client() as anonymous:
        challenge = anonymous.post("/api/v1/enroll/challenge", json={"token": token})
    assert challenge.status_code == 200, challenge.text
    nonce = challenge.json()["nonce"]
    key = X25519PrivateKey.generate()
    raw = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    bound = X25519PrivateKey.generate().public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    quote = td.quote(report_data(nonce, cvm_id, bound if bind_other_key else raw))
    return {
        "token": token,
        "nonce": nonce,
        "quote": base64.b64encode(quote).decode(),
        "public_key": base64.b64encode(raw).decode(),
    }, key


def _audit_actions(team: Any) -> list[tuple[str, dict[str, Any]]]:
    page = team.admin.get(f"/api/v1/teams/{team.name}/audit", params={"limit": 200}).json()
    entries = page["entries"] if isinstance(page, dict) else page
    return [(e["action"], e.get("details", {})) for e in entries]


def _token(team: Any, cvm_id: str) -> str:
    minted = team.admin.post(f"/api/v1/cvms/{cvm_id}/enrollment-token")
    assert minted.status_code == 201, minted.text
    return str(minted.json()["token"])


def test_credential_only_after_attestation_and_tokens_are_single_use(
    console: tuple[Server, LocalIssuer],
) -> None:
    server, issuer = console
    team = new_team(server, issuer)
    try:
        token = _token(team, team.scvm_id)
        td = SimulatedTdx(enroll.pki(), image=enroll.SECURITY_IMAGE)

        body, key = _evidence(server, token, team.scvm_id, td)
        with server.client() as anonymous:
            enrolled = anonymous.post("/api/v1/enroll", json=body)
        assert enrolled.status_code == 200, enrolled.text
        sealed = base64.b64decode(enrolled.json()["sealed_credential"])
        credential = SUITE.decrypt(sealed, key, info=hpke_info(team.scvm_id, body["nonce"]))
        with server.client(credential.decode()) as scvm:
            attachments = scvm.get(f"/api/v1/security-cvms/{team.scvm_id}/attachments")
        assert attachments.status_code == 200, attachments.text
        assert credential not in enrolled.content

        # The same token again: refused, audited, nothing issued.
        with server.client() as anonymous:
            again = anonymous.post("/api/v1/enroll/challenge", json={"token": token})
        assert again.status_code == 403 and "reused_token" in again.text
        actions = _audit_actions(team)
        assert ("cvm.enroll", {"kind": "security"}) in actions
        assert "reused_token" in [d["reason"] for a, d in actions if a == "cvm.enroll_refused"]
    finally:
        team.close()


def test_a_dev_cvm_enrolls_against_its_own_release_and_its_security_cvm_learns_the_hash(
    console: tuple[Server, LocalIssuer], tmp_path: Path
) -> None:
    server, issuer = console
    team = new_team(server, issuer)
    try:
        dev_cvm = team.dev_cvm()
        shown = team.dev.get(f"/api/v1/cvms/{dev_cvm}").json()
        assert "credential" not in shown and "token" not in str(shown)
        # Not yet enrolled: the Security CVM sees the attachment without a credential hash.
        before = team.scvm.get(f"/api/v1/security-cvms/{team.scvm_id}/attachments").json()
        assert before["cvms"][dev_cvm]["credential_sha256"] is None

        # A Dev CVM's quote checked against the Security CVM image's release: refused.
        wrong = SimulatedTdx(enroll.pki(), image=enroll.SECURITY_IMAGE)
        body, _key = _evidence(server, _token(team, dev_cvm), dev_cvm, wrong)
        with server.client() as anonymous:
            refused = anonymous.post("/api/v1/enroll", json=body)
        assert refused.status_code == 403 and "attestation_failed" in refused.text

        credential = enroll.enroll(server.url, team.admin, dev_cvm, enroll.DEV_IMAGE, tmp_path)
        assert credential.startswith("umbra_tun_")
        after = team.scvm.get(f"/api/v1/security-cvms/{team.scvm_id}/attachments").json()
        assert after["cvms"][dev_cvm]["credential_sha256"] == hash_credential(credential)
        assert credential not in str(after)
        # A tunnel credential is not a Console credential.
        with server.client(credential) as as_bearer:
            denied = as_bearer.get(f"/api/v1/security-cvms/{team.scvm_id}/attachments")
        assert denied.status_code == 401
        assert ("cvm.enroll", {"kind": "dev"}) in _audit_actions(team)
    finally:
        team.close()


@pytest.mark.parametrize("attack", ["other_release", "other_key", "other_root"])
def test_a_quote_of_another_release_or_key_is_refused_and_audited(
    console: tuple[Server, LocalIssuer], attack: str
) -> None:
    server, issuer = console
    team = new_team(server, issuer)
    try:
        token = _token(team, team.scvm_id)
        image = "umbra-something-else" if attack == "other_release" else enroll.SECURITY_IMAGE
        pki = SimulatedPki.generate() if attack == "other_root" else enroll.pki()
        td = SimulatedTdx(pki, image=image)
        body, _key = _evidence(
            server, token, team.scvm_id, td, bind_other_key=attack == "other_key"
        )
        with server.client() as anonymous:
            refused = anonymous.post("/api/v1/enroll", json=body)
        assert refused.status_code == 403 and "attestation_failed" in refused.text
        assert "credential" not in refused.json()
        refused = [d for a, d in _audit_actions(team) if a == "cvm.enroll_refused"]
        assert [d["reason"] for d in refused] == ["attestation_failed"] and refused[0]["detail"]
        # Replaying the evidence within the nonce's life is refused the same way (nonces are
        # stateless; the token, not the nonce, is single use).
        with server.client() as anonymous:
            replay = anonymous.post("/api/v1/enroll", json=body)
        assert replay.status_code == 403 and "attestation_failed" in replay.text
    finally:
        team.close()


def test_a_cvm_whose_enrollment_is_refused_fails_with_the_reason(
    console: tuple[Server, LocalIssuer], tmp_path: Path
) -> None:
    """Provisioning ends at enrollment: a CVM whose TD is not its release never reports running;
    a reused token (someone else's replay) does not disturb an enrolled one."""
    server, issuer = console
    team = new_team(server, issuer)
    try:
        dev_cvm = team.dev_cvm()
        assert team.dev.get(f"/api/v1/cvms/{dev_cvm}").json()["state"] == "running"
        impostor = SimulatedTdx(enroll.pki(), image="umbra-something-else")
        body, _key = _evidence(server, _token(team, dev_cvm), dev_cvm, impostor)
        with server.client() as anonymous:
            assert anonymous.post("/api/v1/enroll", json=body).status_code == 403
        failed = team.dev.get(f"/api/v1/cvms/{dev_cvm}").json()
        assert failed["state"] == "failed"
        assert failed["state_reason"] == "enrollment refused: attestation_failed"
        # The audit says which value differed (the verifier's words): what an operator acts on.
        (refusal,) = [d for a, d in _audit_actions(team) if a == "cvm.enroll_refused"]
        assert refusal["reason"] == "attestation_failed" and "rtmr" in refusal["detail"].lower()

        # The genuine TD, with a new token: enrolled, running again.
        token = _token(team, dev_cvm)
        enroll.enroll(server.url, team.admin, dev_cvm, enroll.DEV_IMAGE, tmp_path, token=token)
        assert team.dev.get(f"/api/v1/cvms/{dev_cvm}").json()["state"] == "running"
        # Replaying the spent token is refused and leaves the CVM running.
        with server.client() as anonymous:
            replay = anonymous.post("/api/v1/enroll/challenge", json={"token": token})
        assert replay.status_code == 403 and "reused_token" in replay.text
        assert team.dev.get(f"/api/v1/cvms/{dev_cvm}").json()["state"] == "running"
    finally:
        team.close()


def test_the_client_persists_root_only_and_never_reenrolls_with_a_spent_token(
    console: tuple[Server, LocalIssuer], tmp_path: Path
) -> None:
    server, issuer = console
    team = new_team(server, issuer)
    try:
        token = _token(team, team.scvm_id)
        token_file, credential_file = tmp_path / "token", tmp_path / "state" / "credential"
        token_file.write_text(token)
        td = SimulatedTdx(enroll.pki(), image=enroll.SECURITY_IMAGE)

        def quoter(rd: bytes) -> tuple[bytes, None]:
            return td.quote(rd), None

        args: dict[str, Any] = {
            "console_url": server.url,
            "cvm_id": team.scvm_id,
            "credential_file": credential_file,
            "quoter": quoter,
        }
        credential, enrolled = ensure_credential(token_file=token_file, **args)
        assert enrolled and credential_file.stat().st_mode & 0o777 == 0o600
        assert not token_file.exists()  # spent: removed from the launch directory
        # Restarted: the stored credential, no Console call (no token needed).
        assert ensure_credential(token_file=None, **args) == (credential, False)
        # The credential lost, the spent token back: refused locally, the Console not asked.
        credential_file.unlink()
        token_file.write_text(token)
        audited = len(_audit_actions(team))
        with pytest.raises(EnrollError, match="already spent"):
            ensure_credential(token_file=token_file, **args)
        assert len(_audit_actions(team)) == audited
        assert token not in str(list(tmp_path.rglob("*")))
    finally:
        team.close()


def test_a_dev_cvm_is_routed_to_its_teams_security_cvm_by_default(
    console: tuple[Server, LocalIssuer],
) -> None:
    server, issuer = console
    team = new_team(server, issuer)
    try:
        created = team.dev.post(f"/api/v1/teams/{team.name}/cvms", json={"name": "routed"})
        assert created.status_code == 201, created.text
        assert "credential" not in created.json()
        shown = team.dev.get(f"/api/v1/cvms/{created.json()['id']}").json()
        assert shown["security_cvm_id"] == team.scvm_id  # the developer sees where it routes
    finally:
        team.close()


def test_the_rendered_dev_cvm_forwarder_enrolls_by_address_once_and_keeps_its_credential(
    console: tuple[Server, LocalIssuer], tmp_path: Path
) -> None:
    """The cloud Dev CVM compose's forwarder config, as rendered, with only what the launch agent
    and the TD provide swapped for this machine's: files under tmp and a simulated TD instead of
    configfs. The Console's URL names a host no resolver knows: the forwarder dials the address
    from its launch directory's console-ips (the Dev CVM has no DNS)."""
    server, issuer = console
    team = new_team(server, issuer)
    # The Dev CVM release as shipped: its launch agent measures the CVM id (RTMR3) first.
    verifiers = server.console.enrollment_verifiers
    plain = verifiers["dev"]
    verifiers["dev"] = enroll.verifier(enroll.DEV_IMAGE, events=[{"name": CVM_ID_EVENT}])
    try:
        dev_cvm = team.dev_cvm()
        port = server.url.rsplit(":", 1)[1].split("/")[0]
        text = render_dev_host(dev_definition(console_url=f"https://console.test:{port}").host)
        doc = json.loads(text.text)["forwarder"]
        launch, state = tmp_path / "launch", tmp_path / "state"
        launch.mkdir()
        (launch / "cvm-id").write_text(dev_cvm + "\n")
        token = _token(team, dev_cvm)
        (launch / "enrollment-token").write_text(token + "\n")
        (launch / "console-ips").write_text("127.0.0.1\n")
        pki_dir = tmp_path / "pki"
        enroll.pki().save(pki_dir)
        assert doc["enrollment"]["console_ips_file"] == "/run/umbra/launch/forwarder/console-ips"
        doc["cvm_id_file"] = str(launch / "cvm-id")
        doc["credential_file"] = str(state / "tunnel-credential")
        doc["enrollment"] |= {
            # This Console serves plain HTTP on loopback; the cloud one is https (tested below).
            "console_url": f"http://console.test:{port}",
            "token_file": str(launch / "enrollment-token"),
            "console_ips_file": str(launch / "console-ips"),
            "quote_source": "simulated",
            "simulated_pki": str(pki_dir),
            "simulated_image": enroll.DEV_IMAGE,
            "event_log": None,
        }
        cfg = ForwarderConfig.model_validate(doc)

        assert ensure_tunnel_credential(cfg) is True
        credential = (state / "tunnel-credential").read_text().strip()
        assert credential.startswith("umbra_tun_")
        assert (state / "tunnel-credential").stat().st_mode & 0o777 == 0o600
        after = team.scvm.get(f"/api/v1/security-cvms/{team.scvm_id}/attachments").json()
        assert after["cvms"][dev_cvm]["credential_sha256"] == hash_credential(credential)
        # Restart (and a reboot, where the launch agent writes the same token again): the stored
        # credential, no Console call, the token never spent twice.
        (launch / "enrollment-token").write_text(token + "\n")
        audited = len(_audit_actions(team))
        assert ensure_tunnel_credential(cfg) is False
        assert len(_audit_actions(team)) == audited
        # A reboot loses the credential (tmpfs): the forwarder re-enrolls by a fresh quote of the
        # same launch, never presenting the spent token (console/reenrollment.py).
        (state / "tunnel-credential").unlink()
        assert ensure_tunnel_credential(cfg) is True
        renewed = (state / "tunnel-credential").read_text().strip()
        assert renewed.startswith("umbra_tun_") and renewed != credential
        after = team.scvm.get(f"/api/v1/security-cvms/{team.scvm_id}/attachments").json()
        assert after["cvms"][dev_cvm]["credential_sha256"] == hash_credential(renewed)
        assert [a for a, _ in _audit_actions(team)[audited:]] == ["cvm.reenroll"]
        assert not any(token in p.read_text() for p in state.iterdir())
    finally:
        verifiers["dev"] = plain
        team.close()


def test_two_team_stack_replicas_enroll_each_as_itself_and_serve_the_pool(
    console: tuple[Server, LocalIssuer], tmp_path: Path
) -> None:
    """The whole path of a cloud Security CVM pool, every hop real but the cloud: an admin
    registers replicas 0 and 1 (one-time tokens), the operator puts ids and tokens (as secrets)
    into the team stack's config, the team program (under Pulumi mocks) builds each replica's
    launch data, the image's launch agent writes each one's launch directory, and each proxy
    enrolls with its simulated TD. Two identities, both serving the pool's Dev CVMs."""
    from tests.infra.harness import example_stack, raw_of, run_program
    from umbra.components.config import TeamStack, parse_stack_config
    from umbra.components.program import build_team
    from umbra.contracts.enrollment import security_token_key
    from umbra.images.launch_agent import enrollment_token, parse_launch_data, write_launch_dir
    from umbra.proxy.config import ProxyConfig
    from umbra.proxy.enroll import ensure_console_credential

    server, issuer = console
    team = new_team(server, issuer)
    pki_dir, bundle_key = tmp_path / "pki", tmp_path / "bundle.pub"
    enroll.pki().save(pki_dir)
    bundle_key.write_bytes(
        server.bundle_key.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo)
    )
    clients: list[Any] = []
    try:
        url = f"/api/v1/teams/{team.name}/security-replicas/{{}}/enrollment-token"
        minted = [team.admin.post(url.format(i)).json() for i in (0, 1)]
        pool = minted[0]["cvm_id"]

        stack = example_stack("acme-gcp")
        stack["security_cvm"] |= {"replicas": 2, "cvm_ids": [m["cvm_id"] for m in minted]}
        raw = raw_of(stack) | {security_token_key(i): m["token"] for i, m in enumerate(minted)}
        cfg = parse_stack_config(raw, frozenset(security_token_key(i) for i in (0, 1)))
        assert isinstance(cfg, TeamStack)
        mocks, _ = run_program(lambda: build_team(cfg, tmp_path / "root").security.instance_id)

        dev = team.dev.post(
            f"/api/v1/teams/{team.name}/cvms", json={"name": "pooled", "security_cvm_id": pool}
        ).json()["id"]
        credentials = []
        for i, name in enumerate(("acme-security", "acme-security-1")):
            metadata = mocks.one("gcp:compute/instance:Instance", name).inputs["metadata"]
            meta = {k: v for k, v in metadata["value"].items() if k.startswith("umbra-")}
            data = parse_launch_data(meta)
            launch = tmp_path / f"launch-{i}"
            write_launch_dir(launch, data, [], enrollment_token(meta))
            security = launch / "security"
            config = ProxyConfig(
                identities=tmp_path / f"identities-{i}.json",
                traffic_log=tmp_path / f"spool-{i}",
                confdir=tmp_path / f"mitm-{i}",
                console_url=server.url,  # plain HTTP on loopback here; https in the cloud
                security_cvm_id=(security / "security-cvm-id").read_text().strip(),
                console_credential_file=tmp_path / f"state-{i}" / "console-credential",
                enroll_token_file=security / "enrollment-token",
                bundle_keys=[bundle_key],
                quote_source="simulated",
                simulated_pki=pki_dir,
                simulated_image=enroll.SECURITY_IMAGE,
            )
            assert config.security_cvm_id == minted[i]["cvm_id"]
            assert ensure_console_credential(config) is True
            credential = (tmp_path / f"state-{i}" / "console-credential").read_text().strip()
            credentials.append(credential)
            client = server.client(credential)
            clients.append(client)
            doc = client.get(f"/api/v1/security-cvms/{minted[i]['cvm_id']}/attachments")
            assert doc.status_code == 200 and dev in doc.json()["cvms"], doc.text
        assert len(set(credentials)) == 2
        # Attributed apart: each replica's enrollment is its own audit entry.
        enrolled = [t for a, t in _audit_targets(team) if a == "cvm.enroll"]
        assert {m["cvm_id"] for m in minted} <= set(enrolled)
        assert not any(m["token"] in str(list(tmp_path.rglob("*"))) for m in minted)
    finally:
        for client in clients:
            client.close()
        team.close()


def _audit_targets(team: Any) -> list[tuple[str, str]]:
    page = team.admin.get(f"/api/v1/teams/{team.name}/audit", params={"limit": 200}).json()
    entries = page["entries"] if isinstance(page, dict) else page
    return [(e["action"], e["target"]) for e in entries]


def test_a_dev_cvm_enrolls_with_exactly_the_launch_its_provider_recorded(
    console: tuple[Server, LocalIssuer],
) -> None:
    """A Dev CVM's agent measures its SSH keys and host firewall (launch-bound, per instance:
    no release names them). The Console binds the quote to the launch its provider recorded
    (`provider_state.expected_events`): those exact payloads enroll, any other is refused with
    the event named; without a record the release alone refuses them (the emulated cloud's
    first Dev enrollment failed so: "runtime events not in the policy")."""
    server, issuer = console
    team = new_team(server, issuer)
    keys, ruleset = [_ssh_key()], "table inet umbra_host {\n}\n"
    recorded = {
        SSH_KEYS_EVENT: ssh_keys_digest(keys).hex(),
        HOST_FIREWALL_EVENT: hashlib.sha256(ruleset.encode()).hexdigest(),
    }

    def td(cvm_id: str, keys: list[str], ruleset: str) -> SimulatedTdx:
        t = SimulatedTdx(enroll.pki(), image=enroll.DEV_IMAGE)
        t.extend_runtime_event(CVM_ID_EVENT, cvm_id.encode())
        t.extend_runtime_event(SSH_KEYS_EVENT, ssh_keys_digest(keys))
        t.extend_runtime_event(HOST_FIREWALL_EVENT, hashlib.sha256(ruleset.encode()).digest())
        return t

    def attempt(cvm_id: str, t: SimulatedTdx) -> int:
        body, _key = _evidence(server, _token(team, cvm_id), cvm_id, t)
        body["event_log"] = base64.b64encode(dump_dstack_event_log(t.event_log()).encode()).decode()
        with server.client() as anonymous:
            return anonymous.post("/api/v1/enroll", json=body).status_code

    try:
        bound, unrecorded = team.dev_cvm(), team.dev_cvm()
        # As components.launch_data.expected_events records them (this test release names none).
        _record(server, bound, {CVM_ID_EVENT: bound.encode().hex(), **recorded})
        assert attempt(bound, td(bound, [_ssh_key()], ruleset)) == 403  # someone else's keys
        assert attempt(bound, td(bound, keys, ruleset + "# more\n")) == 403  # another ruleset
        assert attempt(bound, td(bound, keys, ruleset)) == 200
        assert team.dev.get(f"/api/v1/cvms/{bound}").json()["state"] == "running"
        assert attempt(unrecorded, td(unrecorded, keys, ruleset)) == 403
        details = {
            (e["target"], e["details"]["detail"])
            for e in _audit_entries(team)
            if e["action"] == "cvm.enroll_refused"
        }
        assert any(t == bound and SSH_KEYS_EVENT in d for t, d in details), details
        assert any(t == bound and HOST_FIREWALL_EVENT in d for t, d in details), details
        assert any(
            t == unrecorded and "runtime events not in the policy" in d for t, d in details
        ), details
    finally:
        team.close()


def _ssh_key() -> str:
    raw = Ed25519PrivateKey.generate().public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    blob = b"\x00\x00\x00\x0bssh-ed25519" + len(raw).to_bytes(4, "big") + raw
    return "ssh-ed25519 " + base64.b64encode(blob).decode()


def _record(server: Server, cvm_id: str, events: dict[str, str]) -> None:
    """What a provider's launch writes (providers_qemu / providers_pulumi `_state`)."""
    with server.console.write() as session:
        cvm = session.get(Cvm, cvm_id)
        assert cvm is not None
        cvm.provider_state = {**cvm.provider_state, EVENTS_KEY: events}
        session.add(cvm)


def _audit_entries(team: Any) -> list[dict[str, Any]]:
    page = team.admin.get(f"/api/v1/teams/{team.name}/audit", params={"limit": 200}).json()
    entries: list[dict[str, Any]] = page["entries"] if isinstance(page, dict) else page
    return entries
