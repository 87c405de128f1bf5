"""DCAP collateral: load from a file, fetch from PCCS endpoints in turn, cache with expiry, or
take it from the attested peer that quotes (relayed, below).

The cache key is (PCCS URL, FMSPC, CA): collateral is per platform family and per issuing CA,
and two PCCS instances may lag each other, so one's answer never stands in for another's.

Relayed collateral: a verifier that reaches no PCCS (a cloud Dev CVM's forwarder) takes the set
its peer sends with its quote (`RelayedCollateral`); the peer fetches it through its own egress
(`CollateralRelay`). Collateral is Intel-signed, so the relay is untrusted: the verifier checks
every signature up to its pinned root (collateral_check.py) and DCAP runs as for a PCCS answer.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

import dcap_qvl
from cryptography import x509

from umbra.attest.errors import (
    CollateralError,
    CollateralRefusal,
    CollateralRefused,
    QuoteParseError,
)
from umbra.contracts.files import write_atomic

_FIELDS = (
    "pck_crl_issuer_chain",
    "root_ca_crl",
    "pck_crl",
    "tcb_info_issuer_chain",
    "tcb_info",
    "tcb_info_signature",
    "qe_identity_issuer_chain",
    "qe_identity",
    "qe_identity_signature",
)

Fetch = Callable[[str, bytes], Awaitable[Any]]


def _iso(ts: object, what: str) -> int:
    if not isinstance(ts, str):
        raise CollateralError(f"collateral {what} is missing")
    try:
        return int(datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp())
    except ValueError:
        raise CollateralError(f"collateral {what} {ts!r} is not an ISO 8601 time") from None


@dataclass(frozen=True)
class Collateral:
    """Collateral as dcap-qvl takes it, plus the dates our policy reasons about."""

    json_text: str
    qvl: Any  # dcap_qvl.QuoteCollateralV3
    fmspc: str
    tcb_info_issue_date: int
    qe_identity_issue_date: int
    next_update: int  # the earlier of the two nextUpdate times

    @cached_property
    def document(self) -> dict[str, str]:
        """The nine fields as text (from_json checked they are all there)."""
        doc = json.loads(self.json_text)
        return {k: str(doc[k]) for k in _FIELDS}

    @cached_property
    def expires_at(self) -> int:
        """When the first part of the set lapses: TCB info, QE identity, or either CRL."""
        when = self.next_update
        try:
            doc = json.loads(self.json_text)
            for key in ("pck_crl", "root_ca_crl"):
                crl = x509.load_der_x509_crl(bytes.fromhex(str(doc.get(key, ""))))
                if crl.next_update_utc is not None:
                    when = min(when, int(crl.next_update_utc.timestamp()))
        except (ValueError, TypeError, x509.InvalidVersion):
            pass  # unreadable CRLs are refused by collateral_check; the dates above still hold
        return when

    @property
    def issue_date(self) -> int:
        """The older of the TCB info and QE identity issue dates: how stale the set is."""
        return min(self.tcb_info_issue_date, self.qe_identity_issue_date)

    @classmethod
    def from_json(cls, text: str | bytes) -> Collateral:
        try:
            doc = json.loads(text)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise CollateralError(f"collateral is not JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise CollateralError("collateral must be a JSON object")
        missing = [f for f in _FIELDS if f not in doc]
        if missing:
            raise CollateralError(f"collateral lacks {', '.join(missing)}")
        try:
            tcb = json.loads(doc["tcb_info"])
            qe = json.loads(doc["qe_identity"])
        except (TypeError, ValueError, RecursionError) as exc:
            raise CollateralError(f"collateral tcb_info/qe_identity is not JSON: {exc}") from None
        if not isinstance(tcb, dict) or not isinstance(qe, dict):
            raise CollateralError("collateral tcb_info/qe_identity must be JSON objects")
        text_s = text.decode() if isinstance(text, bytes) else text
        try:
            qvl = dcap_qvl.QuoteCollateralV3.from_json(text_s)
        except ValueError as exc:
            raise CollateralError(f"dcap-qvl rejects the collateral: {exc}") from None
        return cls(
            json_text=text_s,
            qvl=qvl,
            fmspc=str(tcb.get("fmspc", "")).upper(),
            tcb_info_issue_date=_iso(tcb.get("issueDate"), "tcb_info.issueDate"),
            qe_identity_issue_date=_iso(qe.get("issueDate"), "qe_identity.issueDate"),
            next_update=min(
                _iso(tcb.get("nextUpdate"), "tcb_info.nextUpdate"),
                _iso(qe.get("nextUpdate"), "qe_identity.nextUpdate"),
            ),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> Collateral:
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise CollateralError(f"cannot read collateral {path}: {exc.strerror}") from None
        return cls.from_json(data)

    @classmethod
    def from_qvl(cls, qvl: Any) -> Collateral:
        return cls.from_json(qvl.to_json())


_BEGIN, _END = b"-----BEGIN CERTIFICATE-----", b"-----END CERTIFICATE-----"
_IDENTITIES: dict[bytes, tuple[str, str]] = {}
_MAX_IDENTITIES = 256


def pck_identity(raw_quote: bytes) -> tuple[str, str]:
    """(FMSPC, issuing PCK CA) from the quote's PCK certificate: which collateral fits it.

    dcap-qvl reads them in about 0.5 ms, a third of a whole verification, so the answer is kept
    per PCK chain text (every quote from one platform carries the same chain). It only selects
    collateral: dcap-qvl still checks the FMSPC and chain against it, so a wrong pick fails."""
    start, end = raw_quote.find(_BEGIN), raw_quote.rfind(_END)
    key = raw_quote[start : end + len(_END)] if 0 <= start < end else b""
    hit = _IDENTITIES.get(key) if key else None
    if hit is not None:
        return hit
    try:
        parsed = dcap_qvl.parse_quote(raw_quote)
        identity = parsed.fmspc().upper(), str(parsed.ca())
    except ValueError as exc:
        raise QuoteParseError(
            f"cannot read FMSPC/CA from the PCK certificate: {exc}",
            field="pck_cert_data.chain",
            offset=0,
        ) from None
    if key:
        if len(_IDENTITIES) >= _MAX_IDENTITIES:
            _IDENTITIES.clear()  # bounded: hostile quotes cannot grow it
        _IDENTITIES[key] = identity
    return identity


class CollateralSource(Protocol):
    """Anything that can produce collateral for a quote."""

    def collateral_for(self, raw_quote: bytes, now: int) -> Collateral: ...


@dataclass(frozen=True)
class StaticCollateral:
    """Collateral supplied by the caller (a file next to the quote, or embedded test data)."""

    collateral: Collateral

    def collateral_for(self, raw_quote: bytes, now: int) -> Collateral:
        return self.collateral


@dataclass
class _Entry:
    collateral: Collateral
    expires_at: int


class CollateralCache:
    """In-memory cache, optionally mirrored to a directory so it survives restarts."""

    def __init__(self, directory: Path | None = None) -> None:
        self._entries: dict[tuple[str, str, str], _Entry] = {}
        self._lock = threading.Lock()
        self._dir = directory

    def _path(self, key: tuple[str, str, str]) -> Path | None:
        if self._dir is None:
            return None
        return self._dir / (hashlib.sha256("\0".join(key).encode()).hexdigest() + ".json")

    def get(self, key: tuple[str, str, str], now: int) -> Collateral | None:
        with self._lock:
            entry = self._entries.get(key)
        if entry is None:
            entry = self._load(key)
        if entry is None or now >= entry.expires_at:
            return None
        return entry.collateral

    def put(self, key: tuple[str, str, str], collateral: Collateral, expires_at: int) -> None:
        entry = _Entry(collateral, expires_at)
        with self._lock:
            self._entries[key] = entry
        path = self._path(key)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Collateral is Intel's public data: readable by all, like the default it had.
            document = {"expires_at": expires_at, "collateral": collateral.json_text}
            write_atomic(path, json.dumps(document), 0o644)

    def _load(self, key: tuple[str, str, str]) -> _Entry | None:
        path = self._path(key)
        if path is None or not path.is_file():
            return None
        try:
            doc = json.loads(path.read_text())
            entry = _Entry(Collateral.from_json(doc["collateral"]), int(doc["expires_at"]))
        except (OSError, ValueError, KeyError, TypeError, RecursionError, CollateralError):
            return None  # a damaged cache file is a miss, never an error
        with self._lock:
            self._entries[key] = entry
        return entry


class PccsCollateral:
    """Fetch collateral from PCCS endpoints in the configured order, caching per key.

    A fresh cache entry from any endpoint is used first (earlier endpoints preferred); on a
    miss, endpoints are fetched in order. An endpoint that fails (network, bad data) is
    skipped and the next one tried; all failures are reported together when none answers.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        cache: CollateralCache | None = None,
        max_ttl_seconds: int = 24 * 3600,
        fetch: Fetch | None = None,
    ) -> None:
        if not endpoints:
            raise CollateralError("at least one PCCS endpoint is required")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.cache = cache or CollateralCache()
        self.max_ttl_seconds = max_ttl_seconds
        self._fetch: Fetch = fetch or dcap_qvl.get_collateral
        self.fetch_count = 0

    def _key(self, endpoint: str, raw_quote: bytes) -> tuple[str, str, str]:
        return (endpoint, *pck_identity(raw_quote))

    def cached(self, raw_quote: bytes, now: int) -> Collateral | None:
        """A fresh cache entry from any configured endpoint, earlier endpoints preferred."""
        for endpoint in self.endpoints:
            hit = self.cache.get(self._key(endpoint, raw_quote), now)
            if hit is not None:
                return hit
        return None

    async def acollateral_for(self, raw_quote: bytes, now: int) -> Collateral:
        hit = self.cached(raw_quote, now)
        if hit is not None:
            return hit
        errors: list[str] = []
        for endpoint in self.endpoints:
            key = self._key(endpoint, raw_quote)
            try:
                self.fetch_count += 1
                collateral = Collateral.from_qvl(await self._fetch(endpoint, raw_quote))
            except Exception as exc:  # any fetch failure means: try the next endpoint
                errors.append(f"{endpoint}: {exc}")
                continue
            if collateral.fmspc and collateral.fmspc != key[1]:
                errors.append(f"{endpoint}: answered for FMSPC {collateral.fmspc}, not {key[1]}")
                continue
            # The set's earliest lapse, CRLs included: a cache entry outliving a CRL would hand
            # out a set every verifier refuses as expired until max_ttl ran out.
            expires = min(collateral.expires_at, now + self.max_ttl_seconds)
            self.cache.put(key, collateral, expires)
            return collateral
        raise CollateralError("no PCCS endpoint supplied collateral: " + "; ".join(errors))

    def collateral_for(self, raw_quote: bytes, now: int | None = None) -> Collateral:
        """Blocking form; from inside an event loop use `acollateral_for`."""
        when = int(time.time()) if now is None else now
        hit = self.cached(raw_quote, when)  # no event loop needed for a cache hit
        return hit if hit is not None else asyncio.run(self.acollateral_for(raw_quote, when))


# Real sets are 16-19 KB (tests/data/tdx); a PCK CRL grows with revocations, never by 10x.
MAX_RELAYED_COLLATERAL = 256 * 1024
RELAYED_CACHE_ENTRIES = 8


class RelayedCollateral:
    """Collateral the attested peer sends with its quote (atls.py EVIDENCE `collateral`).

    The bytes are untrusted: refused here when missing, oversized, malformed, for another
    FMSPC or past a nextUpdate; the verifier then checks every signature and CRL up to its
    pinned root and runs DCAP on them exactly as on a PCCS answer. Parsed sets are kept by the
    SHA-256 of their bytes (at most RELAYED_CACHE_ENTRIES), so a peer sending the same set each
    handshake is parsed once; a changed byte is another key, parsed and checked afresh."""

    def __init__(
        self, max_bytes: int = MAX_RELAYED_COLLATERAL, entries: int = RELAYED_CACHE_ENTRIES
    ) -> None:
        self.max_bytes = max_bytes
        self.entries = entries
        self._parsed: OrderedDict[bytes, Collateral] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def collateral_for(self, raw_quote: bytes, now: int) -> Collateral:
        """As a plain source (nothing relayed): refused as missing."""
        return self.accept(raw_quote, None, now)

    def accept(self, raw_quote: bytes, relayed: bytes | None, now: int) -> Collateral:
        if relayed is None:
            raise CollateralRefused(
                CollateralRefusal.MISSING, "the peer sent no collateral with its quote"
            )
        if len(relayed) > self.max_bytes:
            raise CollateralRefused(
                CollateralRefusal.OVERSIZED,
                f"{len(relayed)} bytes, more than the {self.max_bytes} allowed",
            )
        collateral = self._parse(relayed)
        fmspc = pck_identity(raw_quote)[0]
        if collateral.fmspc != fmspc:
            raise CollateralRefused(
                CollateralRefusal.WRONG_FMSPC,
                f"TCB info is for FMSPC {collateral.fmspc or '(none)'}, the quote's PCK is {fmspc}",
            )
        if now < collateral.issue_date or now >= collateral.expires_at:
            raise CollateralRefused(
                CollateralRefusal.STALE,
                f"valid from {collateral.issue_date} until {collateral.expires_at}, now is {now}",
            )
        return collateral

    def _parse(self, relayed: bytes) -> Collateral:
        key = hashlib.sha256(relayed).digest()
        with self._lock:
            hit = self._parsed.get(key)
            if hit is not None:
                self._parsed.move_to_end(key)
                self.hits += 1
                return hit
        try:
            collateral = Collateral.from_json(relayed)
        except CollateralError as exc:
            raise CollateralRefused(CollateralRefusal.MALFORMED, str(exc)) from None
        with self._lock:
            self.misses += 1
            self._parsed[key] = collateral
            while len(self._parsed) > self.entries:
                self._parsed.popitem(last=False)
        return collateral


class CollateralRelay:
    """The attested server's side: the collateral for its own quote, sent with its EVIDENCE.

    Fetched from `source` (PCCS / Intel PCS, through this CVM's own egress) and held per
    (FMSPC, CA); renewed once less than `refresh_margin` seconds of it remain, at most one fetch
    per `retry_seconds`. While a renewal fails the held set is served until it lapses; after
    that nothing is sent and the peer refuses (missing), never a lapsed set."""

    def __init__(
        self,
        source: PccsCollateral,
        *,
        refresh_margin: int = 6 * 3600,
        retry_seconds: int = 300,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.source = source
        self.refresh_margin = refresh_margin
        self.retry_seconds = retry_seconds
        self.clock = clock
        self._held: dict[tuple[str, str], Collateral] = {}
        self._next_fetch: dict[tuple[str, str], int] = {}
        self._lock = asyncio.Lock()
        self.fetches = 0
        self.served = 0
        self.last_error: str | None = None

    async def __call__(self, raw_quote: bytes) -> bytes | None:
        now = int(self.clock())
        key = pck_identity(raw_quote)
        held = self._held.get(key)
        renewing = self._lock.locked() and held is not None and now < held.expires_at
        if not renewing and (held is None or now + self.refresh_margin >= held.expires_at):
            # (While one handshake renews, the others serve the still-valid held set.)
            async with self._lock:
                held = await self._renew(key, raw_quote, now)
        if held is None or now >= held.expires_at:
            return None
        self.served += 1
        return held.json_text.encode()

    async def _renew(self, key: tuple[str, str], raw_quote: bytes, now: int) -> Collateral | None:
        held = self._held.get(key)
        fresh_enough = held is not None and now + self.refresh_margin < held.expires_at
        if fresh_enough or now < self._next_fetch.get(key, 0):
            return held  # renewed meanwhile, or tried too recently
        self._next_fetch[key] = now + self.retry_seconds
        self.fetches += 1
        try:
            # Looked up as of the end of the margin: a cached set lapsing before then is a miss.
            fresh = await self.source.acollateral_for(raw_quote, now + self.refresh_margin)
        except CollateralError as exc:
            self.last_error = str(exc)
            return held
        if len(self._held) >= 8 and key not in self._held:
            self._held.clear()  # one platform per CVM; bounded all the same
        if held is None or fresh.expires_at >= held.expires_at:
            self._held[key] = fresh
        self.last_error = None
        return self._held[key]
