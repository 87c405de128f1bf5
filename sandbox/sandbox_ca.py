"""The Security CVM's interception CA, as the sandbox must trust it.

The forwarder fetches it inside an attested aTLS session (`Forwarder.fetch_ca`, the tunnel
header's `ca` mode), so it comes from a Security CVM whose quote verified: no network in between
can substitute its own CA. It keeps every CA it has attested in one PEM bundle (replicas behind a
load balancer each have their own mitmproxy CA today), written atomically into a volume the
sandbox mounts read-only; `umbra-sandbox-init` installs it with `update-ca-certificates` and again
whenever it changes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization

from umbra.contracts.files import write_atomic

logger = logging.getLogger(__name__)

# Replicas a bundle remembers. A new CA beyond this drops the least recently attested one: each
# Security CVM boot has a new CA (its key lives in the TD), so refusing the 17th, as this did,
# broke every Dev CVM's HTTPS after 16 restarts of its Security CVM.
MAX_CAS = 16
RETRY_FIRST = 1.0
RETRY_MAX = 30.0


class CaError(Exception):
    """What the Security CVM sent is not a usable CA certificate (the message says why)."""


def parse_cas(pem: bytes) -> list[x509.Certificate]:
    """Only CA certificates, at least one; anything else in the reply is refused whole."""
    try:
        certs = x509.load_pem_x509_certificates(pem)
    except ValueError:
        raise CaError("the reply is not PEM certificates") from None
    for cert in certs:
        try:
            bc = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
        except x509.ExtensionNotFound:
            raise CaError("a certificate has no basicConstraints: not a CA") from None
        if not bc.ca:
            raise CaError("a certificate is not a CA (basicConstraints CA:FALSE)")
    return certs


def fingerprint(cert: x509.Certificate) -> str:
    return cert.fingerprint(hashes.SHA256()).hex()


@dataclass
class CaBundle:
    """The CAs this forwarder has attested, least recently attested first, persisted at `path`
    (the order too, as of the last write)."""

    path: Path
    certs: list[x509.Certificate] = field(default_factory=list)

    @classmethod
    def load(cls, path: Path) -> CaBundle:
        """What an earlier run attested (the volume is the forwarder's; the sandbox mounts it
        read-only). An unreadable file starts empty: the next fetch rewrites it."""
        try:
            return cls(path, parse_cas(path.read_bytes()))
        except (OSError, CaError):
            return cls(path)

    def add(self, pem: bytes) -> bool:
        """Merge the attested CA(s) as the most recently attested; True when the set changed
        (and the bundle was rewritten). A CA seen again only moves: no rewrite, so replicas
        answering in turn never make the sandbox re-install its store."""
        fetched: dict[str, x509.Certificate] = {}
        for cert in parse_cas(pem):
            fetched.setdefault(fingerprint(cert), cert)
        if len(fetched) > MAX_CAS:
            raise CaError(f"a reply of {len(fetched)} CAs: more than {MAX_CAS}, refused whole")
        before = {fingerprint(c) for c in self.certs}
        merged = [c for c in self.certs if fingerprint(c) not in fetched] + list(fetched.values())
        dropped, self.certs = merged[:-MAX_CAS], merged[-MAX_CAS:]
        for cert in dropped:
            logger.warning(
                "sandbox CA bundle full: dropped the least recently attested CA %s (%s)",
                fingerprint(cert)[:16], cert.subject.rfc4514_string(),
            )  # fmt: skip
        if fetched.keys() <= before:
            if not self.path.exists():
                self._write()
            return False
        self._write()
        return True

    def pem(self) -> bytes:
        # Re-encoded from the parsed certificates: only certificates are ever written.
        return b"".join(c.public_bytes(serialization.Encoding.PEM) for c in self.certs)

    def _write(self) -> None:
        # 0644: the sandbox's root reads it through a read-only mount.
        write_atomic(self.path, self.pem(), 0o644, sync=True)


async def keep_ca_fresh(
    fetch: Callable[[], Awaitable[bytes | None]],
    bundle: CaBundle,
    refresh: float,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    """Fetch until the first success (backing off), then every `refresh` seconds: each fetch may
    land on another replica, whose CA joins the bundle."""
    delay = RETRY_FIRST
    have = bool(bundle.certs)
    while True:
        pem = await fetch()
        if pem is not None:
            try:
                if bundle.add(pem):
                    logger.warning(
                        "sandbox CA bundle now holds %d attested CA(s): %s",
                        len(bundle.certs),
                        bundle.path,
                    )
                have = True
            except (CaError, OSError) as exc:
                logger.warning("Security CVM CA not installed: %s", exc)
        if have and pem is not None:
            delay = RETRY_FIRST
            await sleep(refresh)
        else:
            await sleep(delay)
            delay = min(delay * 2, RETRY_MAX)
