"""The real Console and the real proxy together: a bundle uploaded and attached at the Console is
pulled, verified and enforced by the proxy, and the proxy's decisions arrive in the Console's
traffic log attributed to the CVM, with every Console call authenticated by the Security CVM's
credential. (test_console_link.py covers rollback, outages and restarts against a stand-in.)"""

from __future__ import annotations

import json
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.console.helpers import Server, Team, new_team, start_server
from tests.console.oidc_issuer import LocalIssuer
from tests.proxy.conftest import Env
from tests.proxy.harness import (
    TrafficLog,
    auth_header,
    connect_tunnel,
    free_port,
    read_response,
    start_proxy,
    status_of,
)
from umbra.attest.collateral import StaticCollateral
from umbra.attest.measurement import MeasurementPolicy
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx
from umbra.attest.verify import Verifier
from umbra.console.release import AttestedReleaseVerifier
from umbra.policy.bundle import generate_key, payload_document, sign_bundle
from umbra.policy.loader import load_policy_dir
from umbra.proxy.identity import hash_credential

CVM_TOKEN = "integration-cvm-credential-7f3a"


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


def _bundle(server: Server, env: Env, tmp: Path) -> bytes:
    directory = tmp / "policies"
    directory.mkdir()
    port = env.origin.port
    (directory / "base.yaml").write_text(
        "apiVersion: umbra/v1\nkind: Profile\nname: base\negress:\n"
        f"  - id: other\n    allow: {{hosts: [other.test], ports: [{port}]}}\n"
    )
    (directory / "keys.yaml").write_text(
        "apiVersion: umbra/v1\nkind: Profile\nname: keys\negress:\n"
        f"  - id: apis\n    allow: {{hosts: [api.test, ai.test], ports: [{port}]}}\n"
        "inject:\n"
        "  - {id: bot, header: Authorization, format: 'Bearer {secret}', secret: team/bot,"
        f" hosts: [api.test], ports: [{port}]}}\n"
        "  - {id: misbound, header: X-Key, format: '{secret}', secret: team/misbound,"
        f" hosts: [ai.test], ports: [{port}]}}\n"
    )
    compiled = [loaded.compiled for loaded in load_policy_dir(directory).profiles.values()]
    return sign_bundle(payload_document(compiled, 1, "integration"), [server.bundle_key])


def _console_args(
    server: Server, team: Team, cvm_id: str, tmp: Path, workdir: Path, env: Env
) -> list[str]:
    """Console mode. The identities file says how a connection proves it is that CVM (the tunnel
    endpoint does this in production); who owns the CVM and what it may reach come from the
    Console."""
    identities = tmp / "identities.json"
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
    credential = tmp / "console-credential"
    credential.write_text(team.scvm.headers["authorization"].removeprefix("Bearer "))
    key = tmp / "bundle.pub"
    key.write_bytes(Path(server.settings.bundle_public_keys[0]).read_bytes())
    return [
        "--console", server.url, "--security-cvm-id", team.scvm_id,
        "--console-credential-file", str(credential), "--bundle-key", str(key),
        "--state-dir", str(workdir / "state"), "--identities", str(identities),
        "--upstream-ca", str(env.ca.cert_path), "--test-allow-upstream", "127.0.0.1/32",
        "--test-resolver", str(env.resolver),
    ]  # fmt: skip


def _status(env: Env, proxy: Any, cvm_id: str, host: str) -> int:
    auth = auth_header(cvm_id, CVM_TOKEN)
    sock, response = connect_tunnel(proxy, f"{host}:{env.origin.port}", sni=host, auth=auth)
    if status_of(response) != 200:
        return status_of(response)
    sock.sendall(f"GET /integration HTTP/1.1\r\nHost: {host}:{env.origin.port}\r\n\r\n".encode())
    return status_of(read_response(sock))


def _wait_for(condition: Any, seconds: float, what: str) -> Any:
    deadline = time.monotonic() + seconds
    while True:
        result = condition()
        if result:
            return result
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_console_policy_reaches_the_proxy_and_its_decisions_reach_the_console(
    env: Env, console: tuple[Server, LocalIssuer], tmp_path: Path
) -> None:
    server, issuer = console
    team: Team = new_team(server, issuer)
    try:
        assert team.upload(1, _bundle(server, env, tmp_path)).status_code == 201
        cvm_id = team.dev_cvm()
        attached = team.admin.put(f"/api/v1/cvms/{cvm_id}/profiles", json={"profiles": ["base"]})
        assert attached.status_code == 200, attached.text

        workdir = tmp_path / "proxy"
        workdir.mkdir()
        proxy = start_proxy(_console_args(server, team, cvm_id, tmp_path, workdir, env), workdir)
        try:
            _wait_for(
                lambda: _status(env, proxy, cvm_id, "other.test") == 200,
                10,
                "the Console's bundle and attachment never took effect at the proxy",
            )
            assert _status(env, proxy, cvm_id, "evil.test") == 403

            def shipped() -> list[dict[str, Any]]:
                page = team.admin.get(
                    f"/api/v1/teams/{team.name}/traffic", params={"cvm_id": cvm_id, "limit": 100}
                ).json()
                records: list[dict[str, Any]] = page["records"]
                hosts = {(r.get("connect_host"), r.get("decision")) for r in records}
                ok = {("other.test", "allow"), ("evil.test", "deny")} <= hosts
                return records if ok else []

            records = _wait_for(shipped, 20, "the proxy's records never reached the Console")
            for record in records:
                assert record["cvm_id"] == cvm_id
                assert record["owner"] == team.dev_subject, "owner comes from the Console"
                assert record["team"] == team.name
        finally:
            output = proxy.stop()
        assert (tmp_path / "console-credential").read_text() not in output, "credential logged"
        assert CVM_TOKEN not in output
    finally:
        team.close()


BOT_SECRET = "bot-secret-released-7c1d9e"
MISBOUND_SECRET = "misbound-secret-4b8a2f"
ROTATED_SECRET = "bot-secret-rotated-5d0e1a"


def test_secrets_are_released_to_the_attested_proxy_and_injected_only_where_bound(
    env: Env, console: tuple[Server, LocalIssuer], tmp_path: Path
) -> None:
    server, issuer = console
    team: Team = new_team(server, issuer)
    pki_dir = tmp_path / "sim-pki"
    pki = SimulatedPki.load_or_create(pki_dir)
    verifier = Verifier(
        MeasurementPolicy(release=SimulatedTdx(pki, image="umbra-security-cvm").release_manifest()),
        StaticCollateral(pki.collateral(int(time.time()) - 3600)),
        allow_simulated=True,
        simulated_root_der=pki.root_der,
    )
    previous = server.console.release_verifier
    server.console.release_verifier = None
    try:
        assert team.upload(1, _bundle(server, env, tmp_path)).status_code == 201
        cvm_id = team.dev_cvm()
        team.admin.put(f"/api/v1/cvms/{cvm_id}/profiles", json={"profiles": ["keys"]})
        for name, value, hosts in (
            ("bot", BOT_SECRET, ["api.test"]),
            ("misbound", MISBOUND_SECRET, ["elsewhere.test"]),
        ):
            put = team.admin.put(
                f"/api/v1/teams/{team.name}/secrets/{name}", json={"value": value, "hosts": hosts}
            )
            assert put.status_code == 200, put.text
        workdir = tmp_path / "proxy"
        workdir.mkdir()
        proxy = start_proxy(
            [*_console_args(server, team, cvm_id, tmp_path, workdir, env),
             "--secrets-from-console", "--quote-source", "simulated",
             "--simulated-pki", str(pki_dir)],
            workdir,
        )  # fmt: skip
        try:
            # No release yet (the Console has no verifier configured): nothing is injected, so
            # requests that need a credential are refused rather than sent without one.
            _wait_for(
                lambda: _status(env, proxy, cvm_id, "api.test") == 403,
                10,
                "a request needing a secret was not refused before any release",
            )
            assert not env.recorder.host_saw("api.test", BOT_SECRET.encode())

            server.console.release_verifier = AttestedReleaseVerifier(verifier)
            _wait_for(
                lambda: _status(env, proxy, cvm_id, "api.test") == 200,
                15,
                "the released secret was never injected",
            )
            assert env.recorder.host_saw("api.test", f"Bearer {BOT_SECRET}".encode())
            # Bound at the Console to another host: the policy's inject rule alone is not enough.
            assert _status(env, proxy, cvm_id, "ai.test") == 403
            assert not env.recorder.contains(MISBOUND_SECRET.encode())

            # Rotation and deletion converge through the long-polled secrets version, in seconds
            # (the periodic release interval is 300 s).
            put = team.admin.put(
                f"/api/v1/teams/{team.name}/secrets/bot",
                json={"value": ROTATED_SECRET, "hosts": ["api.test"]},
            )
            assert put.status_code == 200, put.text
            _wait_for(
                lambda: (
                    _status(env, proxy, cvm_id, "api.test") == 200
                    and env.recorder.host_saw("api.test", f"Bearer {ROTATED_SECRET}".encode())
                ),
                5,
                "the rotated secret was not injected within 5 s",
            )
            deleted = team.admin.delete(f"/api/v1/teams/{team.name}/secrets/bot")
            assert deleted.status_code in (200, 204), deleted.text
            _wait_for(
                lambda: _status(env, proxy, cvm_id, "api.test") == 403,
                5,
                "a deleted secret was still injected after 5 s",
            )
        finally:
            output = proxy.stop()
        for secret in (BOT_SECRET, MISBOUND_SECRET, ROTATED_SECRET):
            assert secret not in output, "a released secret appeared in the proxy's output"
            spool = b"".join(p.read_bytes() for p in (workdir / "spool").glob("*.jsonl"))
            assert secret.encode() not in spool
    finally:
        server.console.release_verifier = previous
        team.close()


def test_two_workers_behind_the_atls_tunnel_attribute_spool_and_ship_on_their_own(
    env: Env, console: tuple[Server, LocalIssuer], tmp_path: Path
) -> None:
    """`--workers 2` with SO_REUSEPORT behind the aTLS tunnel endpoint, end to end: a real
    Forwarder (simulated TEE) connects to the shared tunnel port, the kernel spreads its sessions
    over both workers, every request is attributed to the tunnel's CVM (owner from the Console),
    and each worker spools and ships its own records to the real Console."""
    from tests.proxy.test_tunnel_endpoint import COMPOSE_EVENT, Loop
    from umbra.attest.eventlog import dump_dstack_event_log
    from umbra.sandbox.forwarder import Forwarder
    from umbra.sandbox.models import Endpoint

    server, issuer = console
    team: Team = new_team(server, issuer)
    pki = SimulatedPki.generate()
    pki.save(tmp_path / "pki")
    tdx = SimulatedTdx(pki, image="umbra-security-cvm")
    tdx.extend_runtime_event(*COMPOSE_EVENT)
    (tmp_path / "event_log.json").write_text(dump_dstack_event_log(tdx.event_log()))
    release = tdx.release_manifest(
        events=[{"name": COMPOSE_EVENT[0], "payloads": [COMPOSE_EVENT[1].hex()]}]
    )
    verifier = Verifier(
        MeasurementPolicy(release=release),
        StaticCollateral(pki.collateral(int(time.time()) - 60)),
        allow_simulated=True,
        simulated_root_der=pki.root_der,
    )
    loop = Loop()
    forwarders: list[Forwarder] = []
    try:
        assert team.upload(1, _bundle(server, env, tmp_path)).status_code == 201
        cvm_id = team.dev_cvm()
        attached = team.admin.put(f"/api/v1/cvms/{cvm_id}/profiles", json={"profiles": ["base"]})
        assert attached.status_code == 200, attached.text
        workdir = tmp_path / "proxy"
        workdir.mkdir()
        tunnel_port = free_port()
        proxy = start_proxy(
            [*_console_args(server, team, cvm_id, tmp_path, workdir, env),
             "--workers", "2", "--tunnel-listen", f"127.0.0.1:{tunnel_port}",
             "--quote-source", "simulated", "--simulated-pki", str(tmp_path / "pki"),
             "--event-log", str(tmp_path / "event_log.json")],
            workdir,
        )  # fmt: skip
        try:
            output = proxy.output.read_text()
            assert "(2 workers)" in output
            assert output.count("umbra tunnel endpoint listening") == 2
            fwd = Forwarder(
                cvm_id=cvm_id,
                security_cvm=Endpoint(host="127.0.0.1", port=tunnel_port),
                verifier=verifier,
                listen_host="127.0.0.1",
                proxy_port=0,
                tunnels=[],
                credential=CVM_TOKEN,
                connect_timeout=5,
                handshake_timeout=20,
            )
            loop.run(fwd.start())
            forwarders.append(fwd)
            port = fwd.ports()[0]
            # Each worker pulls the bundle and attachments on its own: wait until both enforce
            # (a request denied by one worker is retried; the spread is per connection).
            paths = [f"/w-atls-{index}" for index in range(20)]
            for path in paths:
                _wait_for(
                    lambda path=path: status_of(_https_via(env, port, proxy.ca, path)) == 200,
                    15,
                    f"{path} was not served through the tunnel",
                )
            spools = [workdir / "spool" / f"worker-{index}" for index in range(2)]

            def spooled(spool: Path) -> set[str]:
                return {
                    str(r.get("path"))
                    for r in TrafficLog(spool).records()
                    if r.get("path") in paths and r["decision"] == "allow"
                }

            _wait_for(
                lambda: set().union(*map(spooled, spools)) == set(paths), 10, "records missing"
            )
            # The kernel spread the tunnel sessions: both workers served some (20 sessions: a
            # one-sided split has probability 2**-19).
            assert all(spooled(spool) for spool in spools)
            for spool in spools:
                for record in TrafficLog(spool).records():
                    if record.get("path") in paths:
                        assert record["cvm_id"] == cvm_id
                        assert record["owner"] == team.dev_subject

            def shipped() -> set[str]:
                page = team.admin.get(
                    f"/api/v1/teams/{team.name}/traffic", params={"cvm_id": cvm_id, "limit": 500}
                ).json()
                return {
                    str(r["path"])
                    for r in page["records"]
                    if r.get("path") in paths and r["decision"] == "allow"
                }

            _wait_for(lambda: shipped() == set(paths), 20, "records never reached the Console")
            # Each worker shipped its own spool: each has its own cursor past its records.
            for spool in spools:
                assert json.loads((spool / "cursor.json").read_text())["offset"] > 0
        finally:
            output = proxy.stop()
        assert "a worker exited" not in output
        assert CVM_TOKEN not in output
    finally:
        loop.stop(forwarders)
        team.close()


def _https_via(env: Env, port: int, ca: Path, path: str) -> bytes:
    """CONNECT through a forwarder as the sandbox would (no proxy credentials), then GET."""
    target = f"other.test:{env.origin.port}"
    sock = socket.create_connection(("127.0.0.1", port), timeout=20)
    sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    response = read_response(sock, timeout=20)
    if status_of(response) != 200:
        sock.close()
        return response
    context = ssl.create_default_context(cafile=str(ca))
    with context.wrap_socket(sock, server_hostname="other.test") as tls:
        tls.sendall(f"GET {path} HTTP/1.1\r\nHost: {target}\r\nConnection: close\r\n\r\n".encode())
        return read_response(tls, timeout=20)
