"""Provider adapters: how the Console makes a CVM exist. State lives in the Console's database; an
adapter performs the side effect and returns a reference plus the facts the provider reported.

`local` is the embedded default: the Dev CVM is a network namespace and the Security CVM a local
proxy, both started by the machine's own tooling, so the adapter records intent and hands back a
reference at once (`background = False`: the Console calls it inside the request's transaction).
`qemu` (`providers_qemu.py`) boots the built OS image on an emulated cloud (GCP or Azure shape).
`gcp` and `azure` (`providers_pulumi.py`) drive the Pulumi Automation API; a run takes minutes, so
(`background = True`) the Console records a transitional state, runs the adapter in a worker
thread outside any transaction, and records the outcome (`provisioning.py`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from umbra.console.enums import CvmKind

if TYPE_CHECKING:
    from umbra.console.config import Settings


_CONTROL = re.compile(r"[\x00-\x1f\x7f]+")


def one_line(text: str, limit: int = 300) -> str:
    """Provider text as the API shows it: no control characters (the schemas refuse them)."""
    return _CONTROL.sub(" ", text).strip()[:limit]


class ProviderError(Exception):
    """The provider refused or failed; the message is safe to show to the caller."""


class ProviderUnsupported(ProviderError):
    """The request is valid but this provider cannot do it (a 422, not a provider failure)."""


@dataclass(frozen=True)
class CvmSpec:
    id: str
    team: str
    name: str
    kind: CvmKind
    owner: str
    ssh_keys: tuple[str, ...] = ()
    size: str | None = None
    data_disk_gb: int | None = None  # None: the provider's default_data_disk_gb
    # Launch only: the one-time enrollment token the provider puts in the CVM's launch data
    # (`umbra-enrollment-token`), the only credential launch data ever carries. Held in memory
    # for the launch run (the database keeps its hash), never shown (repr).
    enrollment_token: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class ProviderEvent:
    kind: str
    message: str


OnProviderEvent = Callable[[ProviderEvent], None]


@dataclass(frozen=True)
class Provisioned:
    ref: str
    state: dict[str, Any] = field(default_factory=dict)


class CvmProvider(Protocol):
    name: str
    background: bool
    # Every operation may simply be run again after an interruption (Pulumi converges a stack):
    # `provisioning.reconcile` then resumes an interrupted run instead of failing it.
    resumable: bool
    # The data disk (GB) a Dev CVM launched without `data_disk_gb` gets; what the Console records
    # and the team's disk quotas count. None: the provider allocates no disk of its own (local).
    default_data_disk_gb: int | None

    def check(self, spec: CvmSpec) -> None:
        """Refuse (ProviderError) a spec this provider cannot launch, before anything is stored."""
        ...

    def launch(self, spec: CvmSpec, on_event: OnProviderEvent) -> Provisioned:
        """Create the CVM; return the provider's reference for it."""
        ...

    def update(self, spec: CvmSpec, ref: str, on_event: OnProviderEvent) -> Provisioned:
        """Apply new launch inputs (SSH keys, size)."""
        ...

    def set_running(self, ref: str, running: bool) -> None: ...

    def destroy(self, spec: CvmSpec, ref: str | None, on_event: OnProviderEvent) -> None: ...


class LocalProvider:
    """No cloud: the CVM row is the whole state. Nothing is kept in memory, so a restart or a
    second worker process serves the same CVMs."""

    name = "local"
    background = False
    resumable = False
    default_data_disk_gb: int | None = None

    def check(self, spec: CvmSpec) -> None:
        return None

    @staticmethod
    def _known(ref: str) -> None:
        if not ref.startswith("local:"):
            raise ProviderError(f"local provider knows no CVM {ref!r}")

    def launch(self, spec: CvmSpec, on_event: OnProviderEvent) -> Provisioned:
        return Provisioned(f"local:{spec.team}/{spec.name}/{spec.id}")

    def update(self, spec: CvmSpec, ref: str, on_event: OnProviderEvent) -> Provisioned:
        self._known(ref)
        return Provisioned(ref)

    def set_running(self, ref: str, running: bool) -> None:
        self._known(ref)

    def destroy(self, spec: CvmSpec, ref: str | None, on_event: OnProviderEvent) -> None:
        if ref is not None:
            self._known(ref)


KNOWN_PROVIDERS = ("local", "gcp", "azure", "qemu")


def build_providers(settings: Settings, *, stack_factory: Any = None) -> dict[str, CvmProvider]:
    """`stack_factory` replaces the Pulumi CLI for the cloud adapters (tests)."""
    providers: dict[str, CvmProvider] = {}
    for name in settings.providers:
        if name == "local" and settings.local_cvm_config is not None:
            # `umbra up`: Dev CVMs become real local sandboxes.
            from umbra.console.providers_local import LocalCvmProvider, load_settings

            providers[name] = LocalCvmProvider(load_settings(settings.local_cvm_config))
        elif name == "local":
            providers[name] = LocalProvider()
        elif name in ("gcp", "azure"):
            # Imported here so a local-only Console never loads the Pulumi SDK.
            from umbra.console.providers_pulumi import PulumiCvmProvider

            providers[name] = PulumiCvmProvider.from_settings(
                settings, name, stack_factory=stack_factory
            )
        elif name == "qemu":
            if settings.qemu_cvm_config is None:
                raise ValueError("providers: 'qemu' needs qemu_cvm_config (providers_qemu.py)")
            from umbra.console.providers_qemu import QemuCvmProvider
            from umbra.console.providers_qemu import load_settings as load_qemu

            providers[name] = QemuCvmProvider(load_qemu(settings.qemu_cvm_config))
        else:
            raise ValueError(f"providers: unknown provider {name!r} (known: {KNOWN_PROVIDERS})")
    return providers
