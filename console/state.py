"""Everything one Console app instance holds: settings, engine, validators, keys, adapters."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from threading import Lock

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from umbra.console.config import Settings
from umbra.console.db import WriteGate
from umbra.console.envelope import KeyEncryptionKeys
from umbra.console.metrics import Metrics
from umbra.console.notify import ChangeNotifier
from umbra.console.oidc import OidcValidator
from umbra.console.providers import CvmProvider
from umbra.console.release import SecretReleaseVerifier
from umbra.proxy.policy.bundle import VerifiedBundle, verify_bundle


@dataclass
class Console:
    settings: Settings
    engine: Engine
    oidc: OidcValidator | None
    bundle_keys: list[Ed25519PublicKey]
    keyring: KeyEncryptionKeys | None
    providers: dict[str, CvmProvider]
    release_verifier: SecretReleaseVerifier | None
    metrics: Metrics = field(default_factory=Metrics)
    notifier: ChangeNotifier = field(default_factory=ChangeNotifier)
    _verified: OrderedDict[str, VerifiedBundle] = field(default_factory=OrderedDict)
    _verified_lock: Lock = field(default_factory=Lock)

    def __post_init__(self) -> None:
        self.write_gate = WriteGate(serialize=self.settings.is_sqlite)
        # Cloud provider runs (minutes each) happen here, never inside a request's transaction.
        self.jobs = ThreadPoolExecutor(
            max_workers=self.settings.provider_workers, thread_name_prefix="umbra-provider"
        )

    def session(self) -> Session:
        return Session(self.engine, expire_on_commit=False)

    @contextmanager
    def write(self) -> Iterator[Session]:
        """A write transaction: committed on success, rolled back on any exception."""
        with self.write_gate, self.session() as session, session.begin():
            yield session

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
