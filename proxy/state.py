"""The policy the proxy enforces right now, swapped atomically as new bundles arrive.

A `PolicySource` is either a local policy directory (development) or a verified, signed bundle. The
effective policy for a CVM is composed from its attached profiles and cached per (source, profiles);
a composition that fails yields `deny_all()` for that CVM, never a partial policy.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from umbra.policy import BundleError, EffectivePolicy, PolicyError, VerifiedBundle, deny_all
from umbra.policy.loader import PolicySet
from umbra.proxy.identity import CvmIdentity
from umbra.proxy.scanner import Scanner
from umbra.proxy.secrets import SecretStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PolicySource:
    """One generation of policy: a bundle, a policy directory, or nothing (deny everything)."""

    generation: int
    bundle: VerifiedBundle | None = None
    policy_set: PolicySet | None = None

    @property
    def serial(self) -> int | None:
        return self.bundle.serial if self.bundle is not None else None

    @property
    def label(self) -> str:
        if self.bundle is not None:
            return f"bundle {self.bundle.hash} serial {self.bundle.serial}"
        if self.policy_set is not None:
            return f"policy dir {self.policy_set.root}"
        return "no policy"

    def compose(self, profiles: Sequence[str]) -> EffectivePolicy:
        if self.bundle is not None:
            return self.bundle.compose(profiles)
        if self.policy_set is not None:
            return self.policy_set.compose(profiles)
        return deny_all()


@dataclass(frozen=True)
class Effective:
    policy: EffectivePolicy
    scanner: Scanner
    error: str | None = None


class PolicyState:
    def __init__(self, secrets: SecretStore) -> None:
        self._lock = threading.Lock()
        self._source = PolicySource(generation=0)
        self._secrets = secrets
        self._cache: dict[tuple[int, tuple[str, ...]], Effective] = {}
        self._scanners: dict[str, Scanner] = {}

    @property
    def source(self) -> PolicySource:
        return self._source

    @property
    def secrets(self) -> SecretStore:
        return self._secrets

    def install(
        self, *, bundle: VerifiedBundle | None = None, policy_set: PolicySet | None = None
    ) -> PolicySource:
        """Swap in a new policy generation (one assignment: requests see the old or the new)."""
        with self._lock:
            source = PolicySource(self._source.generation + 1, bundle, policy_set)
            self._source = source
            self._cache = {}
        logger.info("policy now: %s", source.label)
        return source

    def install_secrets(self, secrets: SecretStore) -> None:
        """Swap the secret store; scanners (which match the exact values) are rebuilt with it."""
        with self._lock:
            self._secrets = secrets
            self._scanners = {}
            self._source = dataclasses.replace(self._source, generation=self._source.generation + 1)
            self._cache = {}

    def _scanner(self, policy: EffectivePolicy) -> Scanner:
        scanner = self._scanners.get(policy.hash)
        if scanner is None:
            scanner = Scanner(policy.scan_rules, self._secrets.all_values())
            if len(self._scanners) > 256:
                self._scanners.clear()
            self._scanners[policy.hash] = scanner
        return scanner

    def effective(self, identity: CvmIdentity) -> Effective:
        source = self._source
        key = (source.generation, tuple(sorted(set(identity.profiles))))
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        error = None
        try:
            policy = source.compose(key[1]) if key[1] else deny_all()
        except (BundleError, PolicyError) as exc:
            error = f"profiles {list(key[1])} do not compose: {exc}"
            logger.error("denying everything for %s: %s", identity.cvm_id, error)
            policy = deny_all()
        effective = Effective(policy, self._scanner(policy), error)
        if source is self._source:
            self._cache[key] = effective
        return effective
