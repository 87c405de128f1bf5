"""Module-level behaviour of the pieces the proxy is built from (no network)."""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import json
from pathlib import Path

import httpx
import pytest

from tests.proxy.spool_records import read_records
from umbra.contracts.traffic import TrafficRecord
from umbra.proxy.identity import CvmEntry, StaticIdentities, hash_credential, proxy_auth_header
from umbra.proxy.netcheck import AddressPolicy, AddressVerdict, classify
from umbra.proxy.resolver import StaticResolver
from umbra.proxy.secrets import SecretsError, SecretStore
from umbra.proxy.spool import Shipper, Spool


@pytest.mark.parametrize(
    ("address", "verdict"),
    [
        ("8.8.8.8", AddressVerdict.OK),
        ("127.0.0.1", AddressVerdict.LOOPBACK),
        ("10.0.0.1", AddressVerdict.PRIVATE),
        ("169.254.169.254", AddressVerdict.METADATA),
        ("100.64.0.1", AddressVerdict.CGNAT),
        ("fd00::1", AddressVerdict.ULA),
        ("fe80::1", AddressVerdict.LINK_LOCAL),
        ("::ffff:10.0.0.1", AddressVerdict.PRIVATE),
        ("::ffff:8.8.8.8", AddressVerdict.TRANSITION),
        ("64:ff9b::a00:1", AddressVerdict.PRIVATE),
        ("2002:7f00:1::1", AddressVerdict.TRANSITION),
        ("2001:0:4136:e378:8000:63bf:3fff:fdd2", AddressVerdict.TRANSITION),
        ("0.0.0.0", AddressVerdict.UNSPECIFIED),  # noqa: S104
        ("2606:4700::1111", AddressVerdict.OK),
    ],
)
def test_address_classes(address: str, verdict: AddressVerdict) -> None:
    assert classify(ipaddress.ip_address(address)) is verdict


def test_test_allowance_never_admits_the_proxy_socket() -> None:
    policy = AddressPolicy(test_allow=(ipaddress.ip_network("127.0.0.1/32"),)).with_own(
        [], [(ipaddress.ip_address("127.0.0.1"), 8080)]
    )
    assert policy.check(ipaddress.ip_address("127.0.0.1"), 443) is AddressVerdict.OK
    assert policy.check(ipaddress.ip_address("127.0.0.1"), 8080) is AddressVerdict.PROXY_SELF
    assert policy.check(ipaddress.ip_address("::ffff:127.0.0.1"), 443) is AddressVerdict.LOOPBACK


def test_static_resolver_rebinds() -> None:
    resolver = StaticResolver({"r.test": [["1.1.1.1"], ["10.0.0.1"]]})
    first = asyncio.run(resolver.resolve("r.test"))
    second = asyncio.run(resolver.resolve("r.test"))
    assert [str(a) for a in first] == ["1.1.1.1"] and [str(a) for a in second] == ["10.0.0.1"]


def test_identity_by_source_range_and_credentials() -> None:
    source = StaticIdentities(
        [
            CvmEntry(
                cvm_id="cvm-a",
                owner="alice",
                team="acme",
                profiles=["p"],
                credential_sha256=hash_credential("tok"),
                sources=["10.9.0.0/24 ports 40000-40999"],
            )
        ]
    )
    assert source.by_source("10.9.0.5", 40001) is not None
    assert source.by_source("10.9.0.5", 41000) is None
    assert source.by_source("10.9.1.5", 40001) is None
    identity = source.by_proxy_auth(proxy_auth_header("cvm-a", "tok"))
    assert identity is not None and identity.owner == "alice"
    assert source.by_proxy_auth(proxy_auth_header("cvm-a", "wrong")) is None
    assert source.by_proxy_auth("Bearer tok") is None


def test_secrets_file_must_be_private(tmp_path: Path) -> None:
    path = tmp_path / "secrets.json"
    path.write_text(json.dumps({"team": {"x": "value-123456"}}))
    path.chmod(0o644)
    with pytest.raises(SecretsError) as caught:
        SecretStore.from_file(path)
    assert "value-123456" not in str(caught.value)
    path.chmod(0o600)
    store = SecretStore.from_file(path)
    assert store.resolve("team/x", "anyone", "any.host") == "value-123456"
    assert "value-123456" not in repr(store.all_values())


def test_secrets_bound_at_the_console_resolve_only_for_their_hosts() -> None:
    store = SecretStore(
        {"bot": "team-value-1"},
        {"alice": {"key": "alice-value-1"}, "bob": {"key": "bob-value-1"}},
        hosts={
            ("team/bot", None): frozenset({"api.test"}),
            ("personal/key", "alice"): frozenset({"ai.test"}),
        },
    )
    assert store.resolve("team/bot", "alice", "api.test") == "team-value-1"
    assert store.resolve("team/bot", "alice", "other.test") is None
    assert store.resolve("personal/key", "alice", "ai.test") == "alice-value-1"
    assert store.resolve("personal/key", "alice", "api.test") is None
    assert store.resolve("personal/key", "bob", "api.test") == "bob-value-1", "no binding: policy"
    assert store.resolve("personal/key", "carol", "ai.test") is None


def test_spool_survives_a_torn_line_and_ships_in_order(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    for index in range(5):
        spool.append(TrafficRecord.build(decision="deny", reason=f"r{index}"))
    spool.flush()
    spool.close()
    segment = sorted(tmp_path.glob("segment-*.jsonl"))[-1]
    with segment.open("ab") as handle:
        handle.write(b'{"id": "torn')  # a crash mid-write
    restarted = Spool(tmp_path)  # appends go to a fresh segment
    restarted.append(TrafficRecord.build(decision="deny", reason="after"))
    restarted.flush()
    restarted.close()
    reasons = [r["reason"] for r in read_records(tmp_path)]
    assert reasons == ["r0", "r1", "r2", "r3", "r4", "after"]

    received: list[str] = []
    status = {"code": 503}

    def handler(request: httpx.Request) -> httpx.Response:
        if status["code"] != 202:
            return httpx.Response(status["code"])
        received.extend(r["reason"] for r in json.loads(request.content)["records"])
        return httpx.Response(202)

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    shipper = Shipper(tmp_path, "http://console.invalid", batch_size=4, client=client)

    async def drain() -> None:
        assert await shipper.ship_once() == -1
        status["code"] = 202
        while await shipper.ship_once() > 0:
            pass

    asyncio.run(drain())
    assert received == ["r0", "r1", "r2", "r3", "r4", "after"]
    assert Shipper(tmp_path, "http://console.invalid", client=client)._next_batch()[0] == []


def test_secret_puller_follows_a_changed_version_at_once_and_paces_unchanged_ones() -> None:
    """A Console that answers the version long poll at once: a changed version is released and
    followed by the next poll at once (back-to-back rotations converge); an unchanged one is paced
    at 0.5 s (no hot loop). The Console is replaced by an injected version source."""
    from umbra.proxy.secret_puller import SecretPuller
    from umbra.proxy.state import PolicyState

    versions = iter(["v1", "v2", "v3"])
    polls: list[float] = []
    releases: list[float] = []

    class Scripted(SecretPuller):
        async def version(self, known: str | None, wait: float) -> str | None:
            polls.append(asyncio.get_running_loop().time())
            return next(versions, known)  # three changes, then unchanged forever

        async def run_once(self) -> bool:
            releases.append(asyncio.get_running_loop().time())
            return True

    async def run() -> None:
        async with httpx.AsyncClient() as client:
            puller = Scripted(
                "http://127.0.0.1:9", "sec-1", None, None,  # type: ignore[arg-type]
                PolicyState(SecretStore.empty()), client,
            )  # fmt: skip
            task = asyncio.create_task(puller.run())
            await asyncio.sleep(1.3)
            task.cancel()

    asyncio.run(run())
    assert len(releases) == 3
    assert releases[-1] - releases[0] < 0.2, "a changed version was paced"
    unchanged = polls[3:]
    assert 2 <= len(unchanged) <= 3, polls
    assert all(b - a >= 0.45 for a, b in itertools.pairwise(unchanged)), polls


def test_an_enrolled_dev_cvm_is_known_from_the_consoles_attachments_alone() -> None:
    """The Console serves an enrolled Dev CVM's credential hash; no identities-file entry needed.
    Not enrolled (no hash), unattached, or the wrong credential: unknown and refused."""
    from umbra.proxy.identity import Attachment

    credential = "umbra_tun_" + "k" * 43
    identities = StaticIdentities([])
    enrolled = Attachment(
        owner="dev@x", team="t", profiles=["pypi"], credential_sha256=hash_credential(credential)
    )
    pending = Attachment(owner="dev@x", team="t", profiles=[])
    assert not identities.credential_matches("cvm_a", credential)  # no attachments yet
    identities.set_attachments({"cvm_a": enrolled, "cvm_b": pending})
    assert identities.credential_matches("cvm_a", credential)
    assert not identities.credential_matches("cvm_a", credential + "x")
    identity = identities.lookup("cvm_a")
    assert identity is not None and identity.profiles == ("pypi",)
    assert identities.lookup("cvm_b") is None and not identities.credential_matches("cvm_b", "")
    assert identities.by_proxy_auth(proxy_auth_header("cvm_a", credential)) == identity
    identities.set_attachments({"cvm_b": pending})  # detached: refused at once
    assert not identities.credential_matches("cvm_a", credential)
