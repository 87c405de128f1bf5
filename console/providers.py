"""Provider adapters: how the Console makes a CVM exist. State lives in the Console's database; an
adapter only performs the side effect and returns a provider reference.

`local` is the embedded default: the Dev CVM is a network namespace and the Security CVM a local
proxy, both started by the machine's own tooling, so the adapter records intent and hands back a
reference. `gcp` and `azure` will drive the Pulumi programs under `infra/`; they are declared here
so that configuration can name them, and are refused at startup until implemented.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class ProviderError(Exception):
    """The provider refused or failed; the message is safe to show to the caller."""


class ProviderNotImplemented(ProviderError):
    pass


@dataclass(frozen=True)
class CvmSpec:
    id: str
    team: str
    name: str
    kind: str
    owner: str


class CvmProvider(Protocol):
    name: str

    def launch(self, spec: CvmSpec) -> str:
        """Create the CVM; return the provider's reference for it."""
        ...

    def set_running(self, ref: str, running: bool) -> None: ...

    def destroy(self, ref: str) -> None: ...


class LocalProvider:
    name = "local"

    def __init__(self) -> None:
        self.launched: dict[str, bool] = {}

    def launch(self, spec: CvmSpec) -> str:
        ref = f"local:{spec.team}/{spec.name}/{spec.id}"
        self.launched[ref] = True
        return ref

    def set_running(self, ref: str, running: bool) -> None:
        if ref not in self.launched:
            raise ProviderError(f"local provider knows no CVM {ref!r}")
        self.launched[ref] = running

    def destroy(self, ref: str) -> None:
        self.launched.pop(ref, None)


KNOWN_PROVIDERS = ("local", "gcp", "azure")


def build_providers(names: list[str]) -> dict[str, CvmProvider]:
    providers: dict[str, CvmProvider] = {}
    for name in names:
        if name == "local":
            providers[name] = LocalProvider()
        elif name in ("gcp", "azure"):
            raise ProviderNotImplemented(
                f"providers: {name!r} will drive the Pulumi programs and is not implemented yet"
            )
        else:
            raise ValueError(f"providers: unknown provider {name!r} (known: {KNOWN_PROVIDERS})")
    return providers
