"""The `gcp` and `azure` adapters: the Console's `CvmProvider` on the Pulumi Dev CVM provisioner
(`umbra.components.automation`), one stack per Dev CVM on the team's network.

The Console's record maps onto a `DevCvmSpec`: the CVM name is the stack's `cvm`, the owner (an
OIDC `sub`, free-form) becomes a short `developer` slug, the SSH keys and size come from the
request, and the image, app-compose and measurement manifest from the provider's settings (every
Dev CVM of a cloud boots the same release). Security CVMs belong to the team stack, not here.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import asdict
from typing import Any, Literal

from pulumi import automation as auto

from umbra.attest.errors import AttestError
from umbra.attest.measurement import load_measurement_policy
from umbra.components.automation import (
    DevCvmOutputs,
    DevCvmSpec,
    ProvisionerError,
    ProvisionEvent,
    PulumiDevCvmProvisioner,
    StackFactory,
    TeamTarget,
)
from umbra.components.config import AzurePlacement, GcpPlacement
from umbra.components.ports import DEV_ATTESTED_SSH_PORT
from umbra.console.config import AzureProvider, ConfigError, GcpProvider, Settings
from umbra.console.enums import CvmKind
from umbra.console.providers import (
    CvmSpec,
    OnProviderEvent,
    ProviderError,
    ProviderEvent,
    ProviderUnsupported,
    Provisioned,
    one_line,
)
from umbra.console.session_info import INGRESS_KEY, RELEASE_KEY

# Pulumi's failure text is long and its cause is rarely on the last line: keep most of it.
REASON_LIMIT = 4000
_SLUG = re.compile(r"^[a-z][a-z0-9-]{0,14}[a-z0-9]$")


def developer_slug(owner: str) -> str:
    """The owner as a stack-name part: itself when it already fits, else a stable digest."""
    if _SLUG.match(owner):
        return owner
    return "u" + hashlib.sha256(owner.encode()).hexdigest()[:15]


class PulumiCvmProvider:
    background = True
    resumable = True  # up/destroy on the CVM's own stack converge when run again

    def __init__(
        self,
        name: Literal["gcp", "azure"],
        config: GcpProvider | AzureProvider,
        targets: dict[str, TeamTarget],
        *,
        env: dict[str, str] | None = None,
        stack_factory: StackFactory | None = None,
        release: dict[str, Any] | None = None,
    ) -> None:
        self.name: str = name
        self.config = config
        self.default_data_disk_gb: int | None = config.data_disk_gb
        # The Dev CVM release (the one enrollments are verified against): what `umbra ssh`
        # checks this cloud's Dev CVMs' quotes against. None: not served, the client refuses.
        self.release = release
        self.app_compose = config.app_compose.read_text()
        self._provisioners = {
            team: PulumiDevCvmProvisioner(
                target, org=config.org, env=env, stack_factory=stack_factory
            )
            for team, target in targets.items()
        }

    @classmethod
    def from_settings(
        cls, settings: Settings, name: str, *, stack_factory: StackFactory | None = None
    ) -> PulumiCvmProvider:
        targets: dict[str, TeamTarget] = {}
        release = dev_release(settings)
        try:
            if name == "gcp":
                assert settings.gcp is not None  # Settings refuses `gcp` without its settings
                for team, g in settings.gcp.teams.items():
                    placement = GcpPlacement(project=g.project, region=g.region, zone=g.zone)
                    targets[team] = TeamTarget(team, "gcp", g.team_stack, gcp=placement)
                return cls(
                    "gcp", settings.gcp, targets, stack_factory=stack_factory, release=release
                )
            assert name == "azure" and settings.azure is not None
            for team, a in settings.azure.teams.items():
                placement_az = AzurePlacement(location=a.location, zone=a.zone)
                targets[team] = TeamTarget(team, "azure", a.team_stack, azure=placement_az)
            # The azure-native provider reads the subscription from the environment.
            env = {"ARM_SUBSCRIPTION_ID": str(settings.azure.subscription_id)}
            return cls(
                "azure",
                settings.azure,
                targets,
                env=env,
                stack_factory=stack_factory,
                release=release,
            )
        except (ProvisionerError, ValueError) as exc:
            raise ConfigError(f"{name}: {one_line(str(exc))}") from None

    # -- mapping -------------------------------------------------------------------------------

    def _provisioner(self, team: str) -> PulumiDevCvmProvisioner:
        provisioner = self._provisioners.get(team)
        if provisioner is None:
            raise ProviderUnsupported(f"team {team!r} has no {self.name} team stack configured")
        return provisioner

    def dev_spec(self, spec: CvmSpec) -> DevCvmSpec:
        if spec.kind != CvmKind.dev:
            raise ProviderUnsupported(
                f"{self.name} launches Dev CVMs; a team's Security CVM is part of its team stack"
            )
        try:
            return DevCvmSpec(
                developer=developer_slug(spec.owner),
                cvm=spec.name,
                ssh_authorized_keys=spec.ssh_keys,
                size=spec.size or self.config.default_size,
                image=self.config.image,
                app_compose=self.app_compose,
                measurement_manifest=self.config.measurement_manifest,
                disk_gb=self.config.disk_gb,
                data_disk_gb=spec.data_disk_gb or self.config.data_disk_gb,
                cvm_id=spec.id,
                enrollment_token=spec.enrollment_token,
            )
        except ProvisionerError as exc:
            raise ProviderUnsupported(one_line(str(exc), REASON_LIMIT)) from None

    def check(self, spec: CvmSpec) -> None:
        self._provisioner(spec.team)
        self.dev_spec(spec)

    # -- runs (called from a worker thread, never inside a transaction) -----------------------

    def launch(self, spec: CvmSpec, on_event: OnProviderEvent) -> Provisioned:
        provisioner, dev = self._provisioner(spec.team), self.dev_spec(spec)
        try:
            outputs = provisioner.launch(dev, _relay(on_event))
        except ProvisionerError as exc:
            raise ProviderError(one_line(str(exc), REASON_LIMIT)) from None
        return Provisioned(outputs.stack, self._state(outputs))

    def update(self, spec: CvmSpec, ref: str, on_event: OnProviderEvent) -> Provisioned:
        provisioner, dev = self._provisioner(spec.team), self.dev_spec(spec)
        try:
            outputs = provisioner.update(dev, _relay(on_event))
        except ProvisionerError as exc:
            raise ProviderError(one_line(str(exc), REASON_LIMIT)) from None
        return Provisioned(outputs.stack, self._state(outputs))

    def _state(self, outputs: DevCvmOutputs) -> dict[str, Any]:
        """`provider_state`: the run's outputs, and what `GET /cvms/{id}/session` serves the SSH
        client (checked by it against the quote, never trusted on its own): the attested
        ingress on the VM's private address (no Dev CVM has a public one) and the release."""
        state: dict[str, Any] = _jsonable(asdict(outputs))
        if outputs.private_ip:
            state[INGRESS_KEY] = {"host": outputs.private_ip, "port": DEV_ATTESTED_SSH_PORT}
        if self.release is not None:
            state[RELEASE_KEY] = self.release
        return state

    def set_running(self, ref: str, running: bool) -> None:
        """Stop/start by the stack ref alone: the stack's config holds the whole request, so any
        team's provisioner of this provider (same org, same credentials) can run it."""
        if not ref or not self._provisioners:
            raise ProviderUnsupported(f"{self.name}: no Dev CVM stack to stop or start")
        provisioner = next(iter(self._provisioners.values()))
        try:
            provisioner.set_running(ref, running, lambda _e: None)
        except ProvisionerError as exc:
            raise ProviderError(one_line(str(exc), REASON_LIMIT)) from None

    def destroy(self, spec: CvmSpec, ref: str | None, on_event: OnProviderEvent) -> None:
        provisioner, dev = self._provisioner(spec.team), self.dev_spec(spec)
        try:
            provisioner.destroy(dev, _relay(on_event))
        except ProvisionerError as exc:
            if isinstance(exc.__cause__, auto.StackNotFoundError):
                # A launch that failed before its stack existed left nothing to destroy.
                on_event(ProviderEvent("finished", "no stack to destroy"))
                return
            raise ProviderError(one_line(str(exc), REASON_LIMIT)) from None


def _relay(on_event: OnProviderEvent) -> Any:
    def relay(event: ProvisionEvent) -> None:
        on_event(ProviderEvent(event.kind, one_line(event.message)))

    return relay


def _jsonable(value: dict[str, Any]) -> dict[str, Any]:
    value["expected_events"] = dict(value["expected_events"])
    return value


def dev_release(settings: Settings) -> dict[str, Any] | None:
    """The Dev CVM release manifest from `dev_cvm_release_policy` (None when unset)."""
    path = settings.dev_cvm_release_policy
    if path is None:
        return None
    try:
        release = load_measurement_policy(path, None).release
    except (AttestError, OSError, ValueError) as exc:
        raise ConfigError(f"dev_cvm_release_policy {path}: {one_line(str(exc))}") from None
    return release.model_dump(mode="json", exclude_none=True)
