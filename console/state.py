"""Everything one Console app instance holds: settings, engine, validators, keys, adapters."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from threading import Event, Lock

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from umbra.console import audit
from umbra.console.config import Settings
from umbra.console.console_keys import SharedKeys
from umbra.console.db import WriteGate
from umbra.console.db_watchdog import DatabaseWatchdog
from umbra.console.envelope import KeyEncryptionKeys
from umbra.console.leases import JobLeases
from umbra.console.metrics import Metrics
from umbra.console.notify import ChangeNotifier
from umbra.console.oidc import OidcValidator
from umbra.console.providers import CvmProvider
from umbra.console.refusal_budget import RefusalBudget
from umbra.console.release import AttestedReleaseVerifier, SecretReleaseVerifier
from umbra.console.services.errors import DatabaseUnavailable
from umbra.policy.bundle import VerifiedBundle, verify_bundle


def lock_key(name: str) -> int:
    """A signed 64-bit advisory lock key for a name (the audit chain's key is a small constant)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)


@dataclass
class Console:
    settings: Settings
    engine: Engine
    oidc: OidcValidator | None
    bundle_keys: list[Ed25519PublicKey]
    keyring: KeyEncryptionKeys | None
    providers: dict[str, CvmProvider]
    release_verifier: SecretReleaseVerifier | None
    # Enrollment, per CVM kind: each kind's quotes are verified against its own release.
    enrollment_verifiers: dict[str, AttestedReleaseVerifier] = field(default_factory=dict)
    metrics: Metrics = field(default_factory=Metrics)
    notifier: ChangeNotifier = field(default_factory=ChangeNotifier)
    _verified: OrderedDict[str, VerifiedBundle] = field(default_factory=OrderedDict)
    _verified_lock: Lock = field(default_factory=Lock)

    def __post_init__(self) -> None:
        self.write_gate = WriteGate(serialize=self.settings.is_sqlite)
        self.keys = SharedKeys(self.engine)
        # Set when shutdown begins: a resumable provider's run that fails from then on (its
        # `pulumi` child was ended) stays transitional, as after kill -9, and is resumed.
        self.stopping = Event()
        # PostgreSQL: which replica runs each provider job (row leases, console/leases.py).
        self.leases = JobLeases(
            self.engine,
            enabled=not self.settings.is_sqlite,
            ttl_seconds=self.settings.job_lease_seconds,
        )
        self.watchdog: DatabaseWatchdog | None = None
        if not self.settings.is_sqlite and self.settings.db_unresponsive_seconds > 0:
            self.watchdog = DatabaseWatchdog(
                self.engine,
                interval=self.settings.db_probe_interval_seconds,
                deadline=self.settings.db_unresponsive_seconds,
            )
        self.refusals = RefusalBudget(self.settings.enroll_refusals_per_minute)
        # Cloud provider runs (minutes each) happen here, never inside a request's transaction.
        self.jobs = ThreadPoolExecutor(
            max_workers=self.settings.provider_workers, thread_name_prefix="umbra-provider"
        )

    def session(self) -> Session:
        if self.watchdog is not None and self.watchdog.down:
            raise DatabaseUnavailable("the database is not answering; retry later")
        return Session(self.engine, expire_on_commit=False)

    @contextmanager
    def write(self, *locks: str) -> Iterator[Session]:
        """A write transaction: committed on success, rolled back on any exception.

        `locks` name what the transaction reads and then changes (`cvm:<id>`, `team:<t>:policy`,
        ...). On PostgreSQL each is a transaction-scoped advisory lock taken first, in sorted
        order (no deadlocks between two lock sets), so concurrent writers of one thing run one after
        the other and each reads what the previous committed: every race has one defined outcome.
        This also covers rows that do not exist yet (a first secret PUT), which row locks cannot.
        On SQLite the write gate already serializes every writer."""
        with self.write_gate, self.session() as session:
            with session.begin():
                for key in sorted(set(locks)):
                    self.lock(session, key)
                yield session
            # Committed: count the audit entries it appended, wherever they were appended.
            self.metrics.audit_entries.inc(audit.take_appended(session))

    def lock(self, session: Session, name: str) -> None:
        """Take one more named lock inside a write transaction (after those it already holds)."""
        if not self.settings.is_sqlite:
            session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": lock_key(name)})

    def verified(self, bundle_hash: str, raw: bytes) -> VerifiedBundle:
        """Verify stored bundle bytes again (pinned keys may have changed); cached by hash."""
        with self._verified_lock:
            cached = self._verified.get(bundle_hash)
            if cached is not None:
                self._verified.move_to_end(bundle_hash)
                return cached
        bundle = verify_bundle(raw, self.bundle_keys)
        with self._verified_lock:
            self._verified[bundle_hash] = bundle
            while len(self._verified) > 16:
                self._verified.popitem(last=False)
        return bundle
