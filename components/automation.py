"""Provider adapter the Console calls to launch, update and destroy one developer's Dev CVM through
the Pulumi Automation API: one stack per Dev CVM (`<team>-<developer>-<cvm>` in project
`umbra-dev-cvm`), an inline program that reads the team stack's network outputs through a
StackReference, and engine events turned into small `ProvisionEvent`s for a progress callback.

The Automation API drives the `pulumi` CLI; `stack_factory` is the seam where that happens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import pulumi
from pulumi import automation as auto

from umbra.attest.measurement import canonical_ssh_key
from umbra.components.config import AzurePlacement, GcpPlacement
from umbra.components.cvm import DevCvm, DevCvmArgs, Placement
from umbra.components.network import Cloud

PROJECT = "umbra-dev-cvm"
_NAME = re.compile(r"^[a-z][a-z0-9-]{0,14}[a-z0-9]$")


class ProvisionerError(Exception):
    """Launch/update/destroy failed; the message is safe to show to the Console's caller."""


@dataclass(frozen=True)
class TeamTarget:
    """Where a team lives: its team stack (for network outputs) and its placement."""

    team: str
    cloud: Cloud
    # Fully qualified team stack, e.g. "acme-org/umbra/acme-gcp", read by StackReference.
    team_stack: str
    gcp: GcpPlacement | None = None
    azure: AzurePlacement | None = None

    def __post_init__(self) -> None:
        if not _NAME.match(self.team):
            raise ProvisionerError(f"team {self.team!r} is not a valid name")
        if (self.cloud == "gcp") != (self.gcp is not None) or (self.cloud == "azure") != (
            self.azure is not None
        ):
            raise ProvisionerError(
                f"team {self.team!r}: placement does not match cloud {self.cloud!r}"
            )


@dataclass(frozen=True)
class DevCvmSpec:
    """One Dev CVM as the Console asks for it. app_compose is the release's app-compose.json
    (`umbra image measure --out`); measurement_manifest is the release manifest URL or `sha256:`
    digest; cvm_id is the Console's id, the `umbra.cvm-id` event payload."""

    developer: str
    cvm: str
    ssh_authorized_keys: tuple[str, ...]
    size: str
    image: str
    app_compose: str
    measurement_manifest: str | None = None
    disk_gb: int = 50
    cvm_id: str | None = None

    def __post_init__(self) -> None:
        for what, value in (("developer", self.developer), ("cvm", self.cvm)):
            if not _NAME.match(value):
                raise ProvisionerError(f"{what} {value!r} is not a valid name (a-z, 0-9, -; 2-16)")
        if not self.ssh_authorized_keys:
            raise ProvisionerError(f"developer {self.developer!r} has no SSH keys")
        for key in self.ssh_authorized_keys:
            try:
                canonical_ssh_key(key)
            except ValueError as exc:
                raise ProvisionerError(f"ssh_authorized_keys: {exc}") from None
        try:
            doc = json.loads(self.app_compose)
        except ValueError:
            doc = None
        if not isinstance(doc, dict) or not isinstance(doc.get("docker_compose_file"), str):
            raise ProvisionerError(
                "app_compose is not an app-compose.json document (JSON with docker_compose_file)"
            )


@dataclass(frozen=True)
class ProvisionEvent:
    kind: Literal["started", "resource", "diagnostic", "policy", "summary", "finished", "failed"]
    message: str
    urn: str | None = None
    op: str | None = None
    data: Mapping[str, Any] = field(default_factory=dict)


OnProvisionEvent = Callable[[ProvisionEvent], None]


@dataclass(frozen=True)
class DevCvmOutputs:
    stack: str
    instance_id: str
    private_ip: str
    compose_sha256: str
    ssh_keys_sha256: str
    expected_events: Mapping[str, str]


class StackLike(Protocol):
    """The part of `pulumi.automation.Stack` the provisioner uses (a test double fits too)."""

    def set_all_config(self, config: MutableMapping[str, auto.ConfigValue]) -> None: ...

    def up(self, *, on_event: Callable[[auto.EngineEvent], None]) -> Any: ...

    def destroy(
        self, *, on_event: Callable[[auto.EngineEvent], None], remove: bool = ...
    ) -> Any: ...


StackFactory = Callable[[str, "pulumi.automation.PulumiFn", bool], StackLike]


def translate_event(event: auto.EngineEvent) -> ProvisionEvent | None:
    """Engine events the Console shows; the rest (stdout echo, prelude) are dropped."""
    if event.resource_pre_event is not None:
        md = event.resource_pre_event.metadata
        return ProvisionEvent("resource", f"{md.op.value} {md.type}", urn=md.urn, op=md.op.value)
    if event.res_outputs_event is not None:
        md = event.res_outputs_event.metadata
        return ProvisionEvent(
            "resource", f"done {md.op.value} {md.type}", urn=md.urn, op=md.op.value
        )
    if event.res_op_failed_event is not None:
        md = event.res_op_failed_event.metadata
        return ProvisionEvent(
            "failed", f"failed {md.op.value} {md.type}", urn=md.urn, op=md.op.value
        )
    if event.diagnostic_event is not None and event.diagnostic_event.severity in (
        "warning",
        "error",
    ):
        d = event.diagnostic_event
        return ProvisionEvent(
            "diagnostic", d.message.strip(), urn=d.urn, data={"severity": d.severity}
        )
    if event.policy_event is not None:
        p = event.policy_event
        return ProvisionEvent(
            "policy",
            f"{p.policy_name}: {p.message.strip()}",
            urn=p.resource_urn,
            data={"enforcement": p.enforcement_level},
        )
    if event.summary_event is not None:
        changes = {
            str(k.value if hasattr(k, "value") else k): v
            for k, v in event.summary_event.resource_changes.items()
        }
        return ProvisionEvent("summary", f"changes: {changes}", data={"changes": changes})
    return None


class PulumiDevCvmProvisioner:
    """`launch(spec, on_event) -> DevCvmOutputs`, `update(...)`, `destroy(...)` for one team."""

    def __init__(
        self,
        target: TeamTarget,
        *,
        org: str | None = None,
        env: Mapping[str, str] | None = None,
        stack_factory: StackFactory | None = None,
    ) -> None:
        self.target = target
        self.org = org
        self.env = dict(env or {})
        self._factory = stack_factory or self._local_stack

    # -- what a run is made of (all testable without the CLI) ------------------------------

    def stack_name(self, spec: DevCvmSpec) -> str:
        name = f"{self.target.team}-{spec.developer}-{spec.cvm}"
        return f"{self.org}/{PROJECT}/{name}" if self.org else name

    def stack_config(self, spec: DevCvmSpec) -> dict[str, auto.ConfigValue]:
        cfg = {
            "umbra:team": auto.ConfigValue(self.target.team),
            "umbra:developer": auto.ConfigValue(spec.developer),
            "umbra:cvm": auto.ConfigValue(spec.cvm),
        }
        if self.target.gcp is not None:
            g = self.target.gcp
            cfg |= {
                "gcp:project": auto.ConfigValue(g.project),
                "gcp:region": auto.ConfigValue(g.region),
                "gcp:zone": auto.ConfigValue(g.zone),
            }
        elif self.target.azure is not None:
            cfg["azure-native:location"] = auto.ConfigValue(self.target.azure.location)
        return cfg

    def program(self, spec: DevCvmSpec) -> Callable[[], None]:
        target = self.target

        def run() -> None:
            team = pulumi.StackReference(target.team_stack)
            if target.gcp is not None:
                place = Placement(cloud="gcp", project=target.gcp.project, zone=target.gcp.zone)
                identity: pulumi.Output[Any] | None = team.require_output("dev_identity")
            else:
                assert target.azure is not None
                place = Placement(
                    cloud="azure",
                    location=target.azure.location,
                    zone=target.azure.zone,
                    resource_group_name=team.require_output("resource_group_name"),
                )
                identity = None
            cvm = DevCvm(
                f"{target.team}-{spec.developer}-{spec.cvm}",
                DevCvmArgs(
                    team=target.team,
                    vm_name=f"umbra-{target.team}-{spec.developer}-{spec.cvm}",
                    placement=place,
                    size=spec.size,
                    image=spec.image,
                    disk_gb=spec.disk_gb,
                    subnet_id=team.require_output("dev_subnet_id"),
                    identity=identity,
                    app_compose=spec.app_compose,
                    cvm_id=spec.cvm_id or "",
                    measurement_manifest=spec.measurement_manifest,
                    developer=spec.developer,
                    ssh_authorized_keys=spec.ssh_authorized_keys,
                ),
            )
            pulumi.export("instance_id", cvm.instance_id)
            pulumi.export("private_ip", cvm.private_ip)
            pulumi.export("compose_sha256", cvm.compose_sha256)
            pulumi.export("ssh_keys_sha256", cvm.ssh_keys_sha256)
            pulumi.export("expected_events", cvm.expected_events)

        return run

    # -- the runs ----------------------------------------------------------------------------

    def launch(self, spec: DevCvmSpec, on_event: OnProvisionEvent) -> DevCvmOutputs:
        return self._up(spec, on_event, create=True)

    def update(self, spec: DevCvmSpec, on_event: OnProvisionEvent) -> DevCvmOutputs:
        """Same program with new inputs. Launch-bound data (compose, keys) replaces the VM."""
        return self._up(spec, on_event, create=False)

    def destroy(self, spec: DevCvmSpec, on_event: OnProvisionEvent) -> None:
        name = self.stack_name(spec)
        on_event(ProvisionEvent("started", f"destroy {name}"))
        try:
            stack = self._factory(name, self.program(spec), False)
            stack.destroy(on_event=self._relay(on_event), remove=True)
        except Exception as exc:
            on_event(ProvisionEvent("failed", _short(exc)))
            raise ProvisionerError(f"destroy {name}: {_short(exc)}") from exc
        on_event(ProvisionEvent("finished", f"destroyed {name}"))

    def _up(self, spec: DevCvmSpec, on_event: OnProvisionEvent, *, create: bool) -> DevCvmOutputs:
        name = self.stack_name(spec)
        on_event(ProvisionEvent("started", f"{'launch' if create else 'update'} {name}"))
        try:
            stack = self._factory(name, self.program(spec), create)
            stack.set_all_config(self.stack_config(spec))
            result = stack.up(on_event=self._relay(on_event))
            outputs = _outputs(name, result.outputs)
        except Exception as exc:
            on_event(ProvisionEvent("failed", _short(exc)))
            raise ProvisionerError(f"{name}: {_short(exc)}") from exc
        on_event(
            ProvisionEvent("finished", f"{name} is up", data={"private_ip": outputs.private_ip})
        )
        return outputs

    @staticmethod
    def _relay(on_event: OnProvisionEvent) -> Callable[[auto.EngineEvent], None]:
        def relay(event: auto.EngineEvent) -> None:
            mapped = translate_event(event)
            if mapped is not None:
                on_event(mapped)

        return relay

    def _local_stack(self, name: str, program: auto.PulumiFn, create: bool) -> StackLike:
        opts = auto.LocalWorkspaceOptions(env_vars=self.env or None)
        if create:
            return auto.create_or_select_stack(
                name, project_name=PROJECT, program=program, opts=opts
            )
        return auto.select_stack(name, project_name=PROJECT, program=program, opts=opts)


def _outputs(stack: str, outputs: Mapping[str, Any]) -> DevCvmOutputs:
    def value(key: str) -> Any:
        if key not in outputs:
            raise ProvisionerError(f"stack {stack} has no output {key!r}")
        return outputs[key].value

    return DevCvmOutputs(
        stack=stack,
        instance_id=str(value("instance_id")),
        private_ip=str(value("private_ip")),
        compose_sha256=str(value("compose_sha256")),
        ssh_keys_sha256=str(value("ssh_keys_sha256")),
        expected_events=dict(value("expected_events")),
    )


def _short(exc: BaseException) -> str:
    if isinstance(exc, FileNotFoundError) and "pulumi" in str(exc):
        return "the Pulumi CLI is not installed on this host (`pulumi` is not on PATH)"
    text = str(exc).strip().splitlines()
    return text[-1][:500] if text else type(exc).__name__


__all__: Sequence[str] = (
    "DevCvmOutputs",
    "DevCvmSpec",
    "OnProvisionEvent",
    "ProvisionEvent",
    "ProvisionerError",
    "PulumiDevCvmProvisioner",
    "TeamTarget",
    "translate_event",
)
