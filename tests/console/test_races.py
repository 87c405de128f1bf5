"""Concurrent writes on PostgreSQL with real parallel clients: every race has one defined outcome.

SQLite serializes every writer behind the Console's write gate, which hides all of this; these
run against the PostgreSQL Console only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.console.helpers import (
    CaptureHandler,
    Server,
    Team,
    make_bundle,
    profile,
    standard_bundle,
    unique,
)
from tests.console.oidc_issuer import LocalIssuer

pytestmark = pytest.mark.parametrize("server", ["postgresql"], indirect=True)
PARALLEL = 8


def race(calls: list[Callable[[], httpx.Response]]) -> list[httpx.Response]:
    """Run the calls at the same moment, each on its own thread."""
    barrier = threading.Barrier(len(calls))

    def go(call: Callable[[], httpx.Response]) -> httpx.Response:
        barrier.wait()
        return call()

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(go, calls))


def clients(server: Server, token: str, count: int) -> list[httpx.Client]:
    return [server.client(token) for _ in range(count)]


def token_of(client: httpx.Client) -> str:
    return str(client.headers["Authorization"]).removeprefix("Bearer ")


def test_parallel_sets_of_one_secret(team: Team) -> None:
    url = f"/api/v1/teams/{team.name}/secrets/{unique('s')}"
    pool = clients(team.server, token_of(team.admin), PARALLEL)
    responses = race(
        [lambda c=c, i=i: c.put(url, json={"value": f"v{i}"}) for i, c in enumerate(pool)]
    )  # type: ignore[misc]
    assert [r.status_code for r in responses] == [200] * PARALLEL, [r.text for r in responses]
    # The first PUT raced too: no unique violation, and no version bump lost.
    assert sorted(r.json()["version"] for r in responses) == list(range(1, PARALLEL + 1))


def test_parallel_bundle_uploads_with_one_serial(team: Team) -> None:
    key = team.server.bundle_key
    bundles = [make_bundle(key, 7, [profile(f"p{i}", hosts=["example.com"])]) for i in range(6)]
    pool = clients(team.server, token_of(team.admin), len(bundles))
    url = f"/api/v1/teams/{team.name}/bundles"
    responses = race(
        [lambda c=c, b=b: c.post(url, content=b) for c, b in zip(pool, bundles, strict=True)]
    )  # type: ignore[misc]
    assert sorted(r.status_code for r in responses) == [201] + [409] * 5


def test_parallel_launches_with_one_name(team: Team, issuer: LocalIssuer) -> None:
    url = f"/api/v1/teams/{team.name}/cvms"
    name = unique("main")
    pool = clients(team.server, token_of(team.dev), PARALLEL)
    body = {"name": name, "security_cvm_id": team.scvm_id}
    responses = race([lambda c=c: c.post(url, json=body) for c in pool])  # type: ignore[misc]
    assert sorted(r.status_code for r in responses) == [201] + [409] * (PARALLEL - 1)
    # Names are per owner: another developer may have a CVM with the same name.
    other = team.server.client(issuer.token(unique("dev2"), [f"{team.name}:developer"]))
    assert other.post(url, json=body).status_code == 201


def test_stop_racing_destroy_never_resurrects(team: Team) -> None:
    team.upload(1)
    ids = [team.dev_cvm() for _ in range(4)]
    admin = clients(team.server, token_of(team.admin), 3 * len(ids))
    calls: list[Callable[[], httpx.Response]] = []
    for index, cvm_id in enumerate(ids):
        a, b, c = admin[3 * index : 3 * index + 3]
        calls.append(lambda a=a, i=cvm_id: a.patch(f"/api/v1/cvms/{i}", json={"state": "stopped"}))  # type: ignore[misc]
        calls.append(lambda b=b, i=cvm_id: b.delete(f"/api/v1/cvms/{i}"))  # type: ignore[misc]
        calls.append(
            lambda c=c, i=cvm_id: c.put(f"/api/v1/cvms/{i}/profiles", json={"profiles": ["github"]})  # type: ignore[misc]
        )
    responses = race(calls)
    assert {r.status_code for r in responses} <= {200, 409}, [r.text for r in responses]
    for cvm_id in ids:
        cvm = team.admin.get(f"/api/v1/cvms/{cvm_id}").json()
        assert (cvm["state"], cvm["profiles"]) == ("destroyed", [])
    document = team.scvm.get(f"/api/v1/security-cvms/{team.scvm_id}/attachments").json()
    assert not set(ids) & set(document["cvms"])


def test_parallel_read_modify_write_of_attachments(team: Team) -> None:
    """Two admins each add a profile to what they read: one wins, the other gets 412, not a
    silently lost change."""
    from umbra.console.schemas import profiles_etag

    team.upload(1)
    cvm_id = team.dev_cvm()
    read = team.admin.get(f"/api/v1/cvms/{cvm_id}").json()["profiles"]
    tag = f'"{profiles_etag(read)}"'
    pool = clients(team.server, token_of(team.admin), 2)
    url = f"/api/v1/cvms/{cvm_id}/profiles"
    responses = race(
        [
            lambda c=pool[0]: c.put(
                url, json={"profiles": [*read, "github"]}, headers={"If-Match": tag}
            ),  # type: ignore[misc]
            lambda c=pool[1]: c.put(
                url, json={"profiles": [*read, "web"]}, headers={"If-Match": tag}
            ),  # type: ignore[misc]
        ]
    )
    assert sorted(r.status_code for r in responses) == [200, 412]


def test_parallel_credential_rotations_one_defined_winner(team: Team) -> None:
    pool = clients(team.server, token_of(team.admin), 4)
    url = f"/api/v1/cvms/{team.scvm_id}/credential"
    responses = race([lambda c=c: c.post(url) for c in pool])  # type: ignore[misc]
    assert [r.status_code for r in responses] == [200] * 4
    # Serialized: the rotation that committed last (latest updated_at) holds the only credential.
    ordered = sorted((r.json() for r in responses), key=lambda body: str(body["updated_at"]))
    works = []
    for body in ordered:
        with team.server.client(str(body["credential"])) as scvm:
            status = scvm.get(f"/api/v1/security-cvms/{team.scvm_id}/attachments").status_code
            works.append(status == 200)
    assert works == [False, False, False, True]


def test_database_outage_is_503_with_retry_after(
    team: Team, postgres: Any, log_capture: CaptureHandler
) -> None:
    # Terminate every connection of the Console's database, then make new ones fail: the next
    # request gets a retryable 503, not a 500 with a traceback.
    database = team.server.settings.database_url.rsplit("/", 1)[1]
    import psycopg

    with psycopg.connect(postgres.admin_dsn, autocommit=True) as admin:
        admin.execute(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS false')
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
            (database,),
        )
        try:
            mark = len(log_capture.lines)
            response = team.admin.get(f"/api/v1/teams/{team.name}/cvms")
            assert response.status_code == 503
            assert response.headers["Retry-After"]
            logged = "\n".join(log_capture.lines[mark:])
            assert "OperationalError" in logged  # the type, and nothing more
            assert "Traceback" not in logged and "SELECT" not in logged
        finally:
            admin.execute(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS true')
    assert team.admin.get(f"/api/v1/teams/{team.name}/cvms").status_code == 200


def test_standard_bundle_still_uploads(team: Team) -> None:
    assert team.upload(1, standard_bundle(team.server.bundle_key, 1)).status_code == 201


def test_parallel_conditional_rotations_one_winner_per_version(team: Team) -> None:
    """Rotations carry the version they read (If-Match): of those racing from one version exactly
    one wins and the others get 412; retried from a fresh read, none is ever lost."""
    url = f"/api/v1/teams/{team.name}/secrets/{unique('s')}"
    body = {"value": "v0", "hosts": ["api.example.com"]}
    assert team.admin.put(url, json=body).json()["version"] == 1
    pool = clients(team.server, token_of(team.admin), PARALLEL)
    responses = race(
        [
            lambda c=c, i=i: c.put(url, json=body | {"value": f"v{i}"}, headers={"If-Match": '"1"'})
            for i, c in enumerate(pool)
        ]  # type: ignore[misc]
    )
    assert sorted(r.status_code for r in responses) == [200] + [412] * (PARALLEL - 1)
    assert [r.json()["version"] for r in responses if r.status_code == 200] == [2]

    # Four admins each rotate five times, re-reading the version after every 412.
    rounds, workers = 5, clients(team.server, token_of(team.admin), 4)
    list_url = f"/api/v1/teams/{team.name}/secrets"
    name = url.rsplit("/", 1)[1]

    def rotate_loop(client: httpx.Client) -> list[int]:
        won: list[int] = []
        while len(won) < rounds:
            seen = next(s for s in client.get(list_url).json() if s["name"] == name)["version"]
            answer = client.put(url, json=body, headers={"If-Match": f'"{seen}"'})
            assert answer.status_code in (200, 412), answer.text
            if answer.status_code == 200:
                assert answer.json()["version"] == seen + 1
                won.append(seen + 1)
        return won

    barrier = threading.Barrier(len(workers))

    def go(client: httpx.Client) -> list[int]:
        barrier.wait()
        return rotate_loop(client)

    with ThreadPoolExecutor(len(workers)) as executor:
        results = list(executor.map(go, workers))
    versions = sorted(v for won in results for v in won)
    assert versions == list(range(3, 3 + rounds * len(workers)))  # no version won twice
    final = next(s for s in team.admin.get(list_url).json() if s["name"] == name)
    assert final["version"] == 2 + rounds * len(workers)


def test_default_profiles_racing_launches(team: Team) -> None:
    """A launch gets exactly the defaults committed before it (in audit order), never a mix."""
    team.upload(1)
    defaults = f"/api/v1/teams/{team.name}/default-profiles"
    assert team.admin.put(defaults, json={"profiles": ["github"]}).status_code == 200
    admin = team.server.client(token_of(team.admin))
    devs = clients(team.server, token_of(team.dev), 6)
    url = f"/api/v1/teams/{team.name}/cvms"
    calls: list[Callable[[], httpx.Response]] = [
        lambda: admin.put(defaults, json={"profiles": ["web"]})
    ]
    calls += [
        lambda c=c: c.post(url, json={"name": unique("r"), "security_cvm_id": team.scvm_id})  # type: ignore[misc]
        for c in devs
    ]
    responses = race(calls)
    assert [r.status_code for r in responses] == [200] + [201] * len(devs)
    launched = {r.json()["id"]: r.json()["profiles"] for r in responses[1:]}
    entries = team.admin.get(f"/api/v1/teams/{team.name}/audit?limit=1000").json()["entries"]
    set_at = next(
        e["seq"]
        for e in entries
        if e["action"] == "profiles.defaults" and e["details"]["profiles"] == ["web"]
    )
    for entry in entries:
        if entry["action"] == "cvm.launch" and entry["target"] in launched:
            expected = ["github"] if entry["seq"] < set_at else ["web"]
            assert launched[entry["target"]] == expected, (entry, set_at)
            stored = team.admin.get(f"/api/v1/cvms/{entry['target']}").json()["profiles"]
            assert stored == expected
    document = team.scvm.get(f"/api/v1/security-cvms/{team.scvm_id}/attachments").json()
    assert {cvm_id: document["cvms"][cvm_id]["profiles"] for cvm_id in launched} == launched


def test_parallel_enrollments_with_one_token_issue_one_credential(team: Team) -> None:
    """The same token, nonce and quote sent by several clients at once (a copied launch data
    racing the genuine CVM): exactly one credential is issued, the others are refused."""
    import base64

    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    from tests.console import enroll
    from umbra.attest.simulator import SimulatedTdx
    from umbra.contracts.enrollment import report_data

    cvm_id = team.dev_cvm()
    token = team.admin.post(f"/api/v1/cvms/{cvm_id}/enrollment-token").json()["token"]
    nonce = team.dev.post("/api/v1/enroll/challenge", json={"token": token}).json()["nonce"]
    public = X25519PrivateKey.generate().public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    quote = SimulatedTdx(enroll.pki(), image=enroll.DEV_IMAGE).quote(
        report_data(nonce, cvm_id, public)
    )
    body = {
        "token": token,
        "nonce": nonce,
        "quote": base64.b64encode(quote).decode(),
        "public_key": base64.b64encode(public).decode(),
    }
    pool = [team.server.client() for _ in range(PARALLEL)]
    responses = race([lambda c=c: c.post("/api/v1/enroll", json=body) for c in pool])  # type: ignore[misc]
    codes = sorted(r.status_code for r in responses)
    assert codes == [200] + [403] * (PARALLEL - 1), [r.text for r in responses]
    for client in pool:
        client.close()


def _enroll_body(team: Team, token: str, cvm_id: str) -> dict[str, str]:
    import base64

    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    from tests.console import enroll
    from umbra.attest.simulator import SimulatedTdx
    from umbra.contracts.enrollment import report_data

    nonce = team.dev.post("/api/v1/enroll/challenge", json={"token": token}).json()["nonce"]
    public = X25519PrivateKey.generate().public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    quote = SimulatedTdx(enroll.pki(), image=enroll.SECURITY_IMAGE).quote(
        report_data(nonce, cvm_id, public)
    )
    return {
        "token": token,
        "nonce": nonce,
        "quote": base64.b64encode(quote).decode(),
        "public_key": base64.b64encode(public).decode(),
    }


def test_parallel_registrations_of_a_replica_make_one_record(team: Team) -> None:
    """Two operators (or a retried script) registering replica 2 at once: one pool, one record
    for the replica, and every caller gets its own token for that record."""
    url = f"/api/v1/teams/{team.name}/security-replicas/2/enrollment-token"
    pool = clients(team.server, token_of(team.admin), PARALLEL)
    responses = race([lambda c=c: c.post(url) for c in pool])  # type: ignore[misc]
    assert [r.status_code for r in responses] == [201] * PARALLEL, [r.text for r in responses]
    bodies = [r.json() for r in responses]
    assert len({b["cvm_id"] for b in bodies}) == 1 and len({b["pool_id"] for b in bodies}) == 1
    assert sum(b["created"] for b in bodies) == 1
    assert len({b["token"] for b in bodies}) == PARALLEL
    rows = team.admin.get(f"/api/v1/teams/{team.name}/cvms").json()
    assert sorted(r["replica_index"] for r in rows if r["replica_index"] is not None) == [0, 2]
    for client in pool:
        client.close()


def test_two_replicas_enrolling_at_once_each_get_one_credential(team: Team) -> None:
    """Replicas 0 and 1 boot together, and each one's evidence is also sent by three more
    clients (copied launch data racing the genuine TD): exactly one credential per replica."""
    url = f"/api/v1/teams/{team.name}/security-replicas/{{}}/enrollment-token"
    minted = [team.admin.post(url.format(i)).json() for i in (0, 1)]
    bodies = [_enroll_body(team, m["token"], m["cvm_id"]) for m in minted]
    per = PARALLEL // 2
    senders = [team.server.client() for _ in range(PARALLEL)]
    responses = race(
        [lambda c=c, i=i: c.post("/api/v1/enroll", json=bodies[i // per]) for i, c in enumerate(senders)]  # type: ignore[misc]
    )  # fmt: skip
    for replica in (0, 1):
        codes = sorted(r.status_code for r in responses[replica * per : (replica + 1) * per])
        assert codes == [200] + [403] * (per - 1), [r.text for r in responses]
    enrolled = [r.json()["cvm_id"] for r in responses if r.status_code == 200]
    assert sorted(enrolled) == sorted(m["cvm_id"] for m in minted)
    for client in senders:
        client.close()
