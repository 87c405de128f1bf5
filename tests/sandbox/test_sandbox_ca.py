"""The forwarder's bundle of attested interception CAs: only CA certificates are accepted, each is
kept once, the file is rewritten atomically only when it changes, and the refresher keeps every
replica's CA it meets (the fetch over aTLS itself: tests/proxy/test_tunnel_endpoint.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from umbra.sandbox import sandbox_ca
from umbra.sandbox.sandbox_ca import MAX_CAS, CaBundle, CaError, keep_ca_fresh

from ..certs import self_signed


def _cert(name: str, ca: bool = True) -> bytes:
    return self_signed(name, ca=ca, days=30).cert_pem


def test_bundle_keeps_each_attested_ca_once(tmp_path: Path) -> None:
    a, b = _cert("replica-a"), _cert("replica-b")
    bundle = CaBundle(tmp_path / "ca.pem")
    assert bundle.add(a)
    assert bundle.path.read_bytes() == a
    before = bundle.path.stat().st_ino
    assert not bundle.add(a)  # the same CA: the file is left alone
    assert bundle.path.stat().st_ino == before
    assert bundle.add(b)
    assert bundle.path.read_bytes() == a + b
    # A restart starts from what was attested before.
    assert [sandbox_ca.fingerprint(c) for c in CaBundle.load(bundle.path).certs] == [
        sandbox_ca.fingerprint(c) for c in bundle.certs
    ]
    assert list(tmp_path.iterdir()) == [bundle.path]  # no temp file left


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        (b"not pem", "not PEM certificates"),
        (_cert("leaf", ca=False), "not a CA"),
        (_cert("ok") + _cert("leaf", ca=False), "not a CA"),
    ],
)
def test_bundle_refuses_what_is_not_a_ca(tmp_path: Path, reply: bytes, expected: str) -> None:
    bundle = CaBundle(tmp_path / "ca.pem")
    with pytest.raises(CaError, match=expected):
        bundle.add(reply)
    assert not bundle.path.exists()


def test_only_certificates_are_ever_written(tmp_path: Path) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    bundle = CaBundle(tmp_path / "ca.pem")
    bundle.add(key_pem + _cert("ca"))  # a careless Security CVM serving mitmproxy-ca.pem whole
    assert b"PRIVATE KEY" not in bundle.path.read_bytes()


def test_a_full_bundle_drops_the_least_recently_attested_ca(tmp_path: Path) -> None:
    """Each Security CVM boot has a new CA: the 17th must get in (refusing it broke HTTPS for
    good after 16 restarts), and what goes is the CA attested longest ago, not a replica's CA
    that keeps answering."""
    bundle = CaBundle(tmp_path / "ca.pem")
    replicas = [_cert(f"r{i}") for i in range(MAX_CAS)]
    for pem in replicas:
        bundle.add(pem)
    written = bundle.path.read_bytes()
    assert bundle.add(replicas[0]) is False  # seen again: moved, nothing rewritten
    assert bundle.path.read_bytes() == written
    assert bundle.add(_cert("new-boot")) is True
    names = [c.subject.rfc4514_string() for c in CaBundle.load(bundle.path).certs]
    assert len(names) == MAX_CAS
    assert "CN=new-boot" in names and "CN=r0" in names and "CN=r1" not in names
    assert names[-1] == "CN=new-boot"  # the order persists: the next drop is still the oldest


def test_a_reply_of_more_cas_than_a_bundle_holds_is_refused_whole(tmp_path: Path) -> None:
    bundle = CaBundle(tmp_path / "ca.pem")
    bundle.add(_cert("kept"))
    with pytest.raises(CaError, match="refused whole"):
        bundle.add(b"".join(_cert(f"x{i}") for i in range(MAX_CAS + 1)))
    assert [c.subject.rfc4514_string() for c in bundle.certs] == ["CN=kept"]


async def test_refresher_backs_off_then_collects_every_replica(tmp_path: Path) -> None:
    a, b = _cert("replica-a"), _cert("replica-b")
    replies: list[bytes | None] = [None, None, a, b"garbage", b, a]
    sleeps: list[float] = []

    async def fetch() -> bytes | None:
        return replies.pop(0)

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if not replies:
            raise _Done

    bundle = CaBundle(tmp_path / "ca.pem")
    with pytest.raises(_Done):
        await keep_ca_fresh(fetch, bundle, refresh=300, sleep=sleep)
    assert bundle.path.read_bytes() == a + b
    # Unreachable twice: back off; then the refresh interval (a bad reply changes nothing).
    assert sleeps == [1.0, 2.0, 300, 300, 300, 300]


class _Done(Exception):
    pass
