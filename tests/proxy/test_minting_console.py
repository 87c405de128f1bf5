"""A rotating refresh token end to end: set at the real Console as a developer's personal
`oauth2-refresh` secret, released to the attested proxy, refreshed there (the stand-in endpoint
rotates on every use), and each rotation written back to the Console under a lease, so the chain
survives a re-release: the Console's version advances, the proxy continues from the rotated token,
and a refusal marks the secret as needing a new login."""

from __future__ import annotations

import json
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.console.helpers import Server, Team, new_team, start_server
from tests.console.oidc_issuer import LocalIssuer
from tests.proxy.harness import (
    OriginHandler,
    OriginServer,
    Recorder,
    Seen,
    TestCA,
    curl,
    curl_status,
    start_proxy,
)
from tests.proxy.test_console_integration import CVM_TOKEN
from tests.proxy.token_endpoint import TokenEndpoint
from umbra.attest.collateral import StaticCollateral
from umbra.attest.measurement import MeasurementPolicy
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx
from umbra.attest.verify import Verifier
from umbra.console.release import AttestedReleaseVerifier
from umbra.policy.bundle import generate_key, payload_document, sign_bundle
from umbra.policy.loader import load_policy_dir
from umbra.proxy.identity import hash_credential


@pytest.fixture(scope="module")
def console(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, LocalIssuer]]:
    issuer = LocalIssuer()
    tmp = tmp_path_factory.mktemp("console")
    server = start_server(
        "sqlite", f"sqlite:///{tmp / 'console.db'}", tmp / "console.db", issuer.url,
        generate_key(), tmp,
    )  # fmt: skip
    yield server, issuer
    server.stop()
    issuer.close()


def _bundle(server: Server, port: int, tmp: Path) -> bytes:
    directory = tmp / "policies"
    directory.mkdir()
    (directory / "codex.yaml").write_text(
        "apiVersion: umbra/v1\nkind: Profile\nname: codex\negress:\n"
        f"  - id: api\n    allow: {{hosts: [chatgpt.test], ports: [{port}]}}\n"
        "inject:\n"
        "  - {id: codex, header: Authorization, format: 'Bearer {secret}', secret: personal/codex,"
        f" hosts: [chatgpt.test], ports: [{port}]}}\n"
    )
    compiled = [loaded.compiled for loaded in load_policy_dir(directory).profiles.values()]
    return sign_bundle(payload_document(compiled, 1, "minting"), [server.bundle_key])


def _secret(team: Team) -> dict[str, Any]:
    listed = team.dev.get(f"/api/v1/teams/{team.name}/personal-secrets").json()
    found: dict[str, Any] = next(item for item in listed if item["name"] == "codex")
    return found


def _wait_for(condition: object, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_rotations_are_written_back_and_a_refusal_needs_a_login(
    console: tuple[Server, LocalIssuer], tmp_path: Path
) -> None:
    server, issuer = console
    team = new_team(server, issuer)
    ca = TestCA(tmp_path)
    cert, key = ca.issue(["chatgpt.test", "auth.openai.test"])
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    origin = OriginServer(Recorder(), tls).start()
    port = origin.port
    endpoint = TokenEndpoint(f"https://auth.openai.test:{port}/oauth/token", expires_in=2)
    first = endpoint.start_chain("app_codex")

    def api(handler: OriginHandler, seen: Seen) -> None:
        token = " ".join(seen.header("authorization")).removeprefix("Bearer ")
        handler.send(200 if endpoint.valid(token) else 401, b"ok\n")

    origin.routes |= {"auth.openai.test": endpoint.handle, "chatgpt.test": api}
    pki_dir = tmp_path / "sim-pki"
    pki = SimulatedPki.load_or_create(pki_dir)
    server.console.release_verifier = AttestedReleaseVerifier(
        Verifier(
            MeasurementPolicy(
                release=SimulatedTdx(pki, image="umbra-security-cvm").release_manifest()
            ),
            StaticCollateral(pki.collateral(int(time.time()) - 3600)),
            allow_simulated=True,
            simulated_root_der=pki.root_der,
        )
    )
    assert team.upload(1, _bundle(server, port, tmp_path)).status_code == 201
    cvm_id = team.dev_cvm()
    team.admin.put(f"/api/v1/cvms/{cvm_id}/profiles", json={"profiles": ["codex"]})
    document = {"token_url": endpoint.token_url, "client_id": "app_codex", "refresh_token": first}
    put = team.dev.put(
        f"/api/v1/teams/{team.name}/personal-secrets/codex",
        json={"value": json.dumps(document), "hosts": ["chatgpt.test"], "kind": "oauth2-refresh"},
    )
    assert put.status_code == 200, put.text

    workdir = tmp_path / "proxy"
    workdir.mkdir()
    identities = tmp_path / "identities.json"
    identities.write_text(
        json.dumps(
            {
                "cvms": [
                    {
                        "cvm_id": cvm_id,
                        "owner": "unused",
                        "team": "unused",
                        "profiles": [],
                        "credential_sha256": hash_credential(CVM_TOKEN),
                    }
                ]
            }
        )
    )
    credential = tmp_path / "console-credential"
    credential.write_text(team.scvm.headers["authorization"].removeprefix("Bearer "))
    bundle_key = tmp_path / "bundle.pub"
    bundle_key.write_bytes(Path(server.settings.bundle_public_keys[0]).read_bytes())
    resolver = tmp_path / "resolver.json"
    resolver.write_text(
        json.dumps({"chatgpt.test": ["127.0.0.1"], "auth.openai.test": ["127.0.0.1"]})
    )
    proxy = start_proxy(
        [
            "--console", server.url, "--security-cvm-id", team.scvm_id,
            "--console-credential-file", str(credential), "--bundle-key", str(bundle_key),
            "--state-dir", str(workdir / "state"), "--identities", str(identities),
            "--upstream-ca", str(ca.cert_path), "--test-allow-upstream", "127.0.0.1/32",
            "--test-resolver", str(resolver), "--secrets-from-console",
            "--quote-source", "simulated", "--simulated-pki", str(pki_dir),
        ],
        workdir,
    )  # fmt: skip

    def status(path: str) -> int:
        result = curl(proxy, f"https://chatgpt.test:{port}{path}", cvm=cvm_id, token=CVM_TOKEN)
        return curl_status(result)

    try:
        _wait_for(lambda: status("/first") == 200, 20, "the minted token was never injected")
        # The refresh rotated the chain; the proxy wrote it back: version 2 at the Console,
        # updated by the Security CVM, audited without values.
        _wait_for(lambda: _secret(team)["version"] >= 2, 10, "the rotation was not written back")
        assert str(_secret(team)["updated_by"]).startswith("security-cvm:")
        # Across several token lifetimes, each refresh continues the chain (a spent token would
        # be refused and revoke it), through re-releases of each new version.
        for index in range(3):
            time.sleep(2.1)
            assert status(f"/again-{index}") == 200
        assert endpoint.refused == 0
        assert _secret(team)["version"] >= 4 and _secret(team)["status"] == "ok"
        entries = team.admin.get(f"/api/v1/teams/{team.name}/audit").json()["entries"]
        assert [e["action"] for e in entries].count("secret.refresh") >= 3

        # The user logs out elsewhere: the next refresh is refused, the request gets 403, and
        # the Console shows the secret as needing a new login.
        endpoint.revoke("app_codex")
        time.sleep(2.1)
        assert status("/refused") == 403
        _wait_for(lambda: _secret(team)["status"] == "needs_login", 10, "not marked needs_login")
        calls = endpoint.calls["refresh_token"]
        assert all(status(f"/refused-{i}") == 403 for i in range(3))
        assert endpoint.calls["refresh_token"] == calls  # no retry storm
        # A new login (`umbra secret set` / `umbra codex connect`) clears it at once.
        document["refresh_token"] = endpoint.start_chain("app_codex")
        put = team.dev.put(
            f"/api/v1/teams/{team.name}/personal-secrets/codex",
            json={
                "value": json.dumps(document),
                "hosts": ["chatgpt.test"],
                "kind": "oauth2-refresh",
            },
        )
        assert put.status_code == 200 and put.json()["status"] == "ok"
        _wait_for(lambda: status("/relogged") == 200, 10, "the new login was not used")
    finally:
        output = proxy.stop()
        origin.shutdown()
        team.close()
    secrets = {first, *endpoint.spent, *endpoint.issued, *endpoint.current_refresh.values()}
    spool = b"".join(p.read_bytes() for p in (workdir / "spool").glob("*.jsonl"))
    for value in secrets:
        assert value not in output and value.encode() not in spool
