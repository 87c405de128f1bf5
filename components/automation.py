"""Provider adapter the Console calls to launch, update and destroy one developer's Dev CVM through
the Pulumi Automation API: one stack per Dev CVM (`<team>-<developer>-<cvm>` in project
`umbra-dev-cvm`), an inline program that reads the team stack's network outputs through a
StackReference, and engine events turned into small `ProvisionEvent`s for a progress callback.

The Automation API drives the `pulumi` CLI; `stack_factory` is the seam where that happens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import stat
import tempfile
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Literal, Protocol

import pulumi
from pulumi import automation as auto

from umbra.attest.measurement import canonical_ssh_key
from umbra.components.config import AzurePlacement, GcpPlacement
from umbra.components.cvm import DevCvm, DevCvmArgs, Placement
from umbra.components.naming import Owner, dev_cvm_name
from umbra.components.network import Cloud

PROJECT = "umbra-dev-cvm"
# The policy pack every Console launch runs under (the same one team stacks use).
POLICY_PACK = Path(__file__).resolve().parents[1] / "infra" / "policy_pack"
DEV_CVM_KEY = "umbra:devCvm"
RUNNING_KEY = "umbra:running"
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
    data_disk_gb: int = 100
    # The Console's one-time enrollment token for the launch data (kept as a Pulumi secret).
    enrollment_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        # From JSON (the stack's own config) the keys arrive as a list.
        object.__setattr__(self, "ssh_authorized_keys", tuple(self.ssh_authorized_keys))
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


class EngineStack(Protocol):
    """The part of `pulumi.automation.Stack` `RobustStack` drives (a fake engine fits too)."""

    @property
    def workspace(self) -> Any: ...

    def set_all_config(self, config: MutableMapping[str, auto.ConfigValue]) -> None: ...

    def up(
        self, *, on_event: Callable[[auto.EngineEvent], None], policy_packs: list[str] | None = ...
    ) -> Any: ...

    def refresh(self, *, on_event: Callable[[auto.EngineEvent], None]) -> Any: ...

    def destroy(
        self, *, on_event: Callable[[auto.EngineEvent], None], remove: bool = ...
    ) -> Any: ...

    def cancel(self) -> None: ...

    def export_stack(self) -> auto.Deployment: ...

    def import_stack(self, state: auto.Deployment) -> None: ...


# Provider plugins an inline program needs (a fresh Console host has none): package -> plugin.
PLUGINS = {"pulumi-gcp": "gcp", "pulumi-azure-native": "azure-native"}


def installed_plugins() -> dict[str, str]:
    """Plugin name -> version, matching the provider SDKs installed with the Console."""
    out = {}
    for package, plugin in PLUGINS.items():
        try:
            out[plugin] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return out


class RobustStack:
    """A real stack made safe to re-run: plugins installed, a crashed run's lock cancelled and
    its pending operations cleared, state refreshed before every up/destroy, and the policy pack
    applied to every update. Assumes the Console is the only writer of a Dev CVM stack (it runs
    one operation per CVM at a time), so a lock found here is a crashed run's, not a live one."""

    def __init__(
        self,
        stack: EngineStack,
        *,
        policy_packs: Sequence[str],
        plugins: Mapping[str, str],
        on_notice: Callable[[str], None] = lambda _m: None,
    ) -> None:
        self.stack = stack
        self.policy_packs = list(policy_packs)
        self.plugins = dict(plugins)
        self.on_notice = on_notice
        self._prepared = False

    def set_all_config(self, config: MutableMapping[str, auto.ConfigValue]) -> None:
        self.stack.set_all_config(config)

    def _prepare(self) -> None:
        if self._prepared:
            return
        for name, version in sorted(self.plugins.items()):
            self.stack.workspace.install_plugin(name, version)
        self._prepared = True

    def recover(self) -> None:
        """Cancel a stale update and drop pending operations a crash left in the state."""
        # Nothing to cancel, or a backend without `pulumi cancel`: carry on.
        with contextlib.suppress(auto.CommandError):
            self.stack.cancel()
        state = self.stack.export_stack()
        deployment = dict(state.deployment or {})
        pending = list(deployment.get("pending_operations") or [])
        if not pending:
            return
        for op in pending:
            urn = (op.get("resource") or {}).get("urn", "?")
            # A pending create may have made a cloud resource the state does not know.
            self.on_notice(f"cleared pending {op.get('type', '?')} of {urn}: check for orphans")
        deployment["pending_operations"] = []
        state.deployment = deployment
        self.stack.import_stack(state)

    def _run(self, step: Callable[[], Any]) -> Any:
        self._prepare()
        try:
            return step()
        except auto.ConcurrentUpdateError:
            self.on_notice("the stack was locked by an interrupted run; cancelling it")
            self.recover()
            return step()

    def up(self, *, on_event: Callable[[auto.EngineEvent], None]) -> Any:
        def step() -> Any:
            self._check_pending()
            self.stack.refresh(on_event=on_event)
            return self.stack.up(on_event=on_event, policy_packs=self.policy_packs)

        return self._run(step)

    def destroy(self, *, on_event: Callable[[auto.EngineEvent], None], remove: bool = False) -> Any:
        def step() -> Any:
            self._check_pending()
            self.stack.refresh(on_event=on_event)
            return self.stack.destroy(on_event=on_event, remove=remove)

        return self._run(step)

    def _check_pending(self) -> None:
        state = self.stack.export_stack()
        if (state.deployment or {}).get("pending_operations"):
            self.recover()


# Cloud and engine errors worth another try; anything else (quota, policy, bad input) is final.
TRANSIENT = re.compile(
    r"\b(429|500|502|503|504)\b|rateLimitExceeded|RESOURCE_EXHAUSTED: .*rate|TooManyRequests|"
    r"ServiceUnavailable|InternalServerError|AnotherOperationInProgress|"
    r"resourceNotReady|connection reset|timed? ?out|temporarily unavailable",
    re.IGNORECASE,
)


class PulumiDevCvmProvisioner:
    """`launch(spec, on_event) -> DevCvmOutputs`, `update(...)`, `set_running(...)`,
    `destroy(...)` for one team."""

    def __init__(
        self,
        target: TeamTarget,
        *,
        org: str | None = None,
        env: Mapping[str, str] | None = None,
        stack_factory: StackFactory | None = None,
        policy_packs: Sequence[str] = (str(POLICY_PACK),),
        attempts: int = 3,
        backoff_s: float = 5.0,
        sleep: Callable[[float], None] = time.sleep,
        work_root: Path | None = None,
    ) -> None:
        self.target = target
        # The Automation API's workspace (Pulumi.yaml, the stack's settings) lives in one directory
        # per stack, reused by every run: without `work_dir` each run left a new temp dir behind.
        self.work_root = work_root or Path(tempfile.gettempdir()) / f"umbra-pulumi-{os.getuid()}"
        self.org = org
        self.env = dict(env or {})
        self.policy_packs = tuple(policy_packs)
        if not self.policy_packs:
            raise ProvisionerError("a Dev CVM stack runs under the Umbra policy pack; none given")
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.sleep = sleep
        self._factory = stack_factory or self._local_stack

    # -- what a run is made of (all testable without the CLI) ------------------------------

    def stack_name(self, spec: DevCvmSpec) -> str:
        name = f"{self.target.team}-{spec.developer}-{spec.cvm}"
        return f"{self.org}/{PROJECT}/{name}" if self.org else name

    def vm_name(self, spec: DevCvmSpec) -> str:
        return dev_cvm_name(self.target.team, spec.developer, spec.cvm, Owner.CONSOLE)

    def stack_config(self, spec: DevCvmSpec, running: bool = True) -> dict[str, auto.ConfigValue]:
        cfg = {
            "umbra:team": auto.ConfigValue(self.target.team),
            "umbra:developer": auto.ConfigValue(spec.developer),
            "umbra:cvm": auto.ConfigValue(spec.cvm),
            # The whole request, so stop/start can re-run the same program from the ref alone.
            DEV_CVM_KEY: auto.ConfigValue(
                json.dumps(
                    {"target": _target_doc(self.target), "spec": dataclasses.asdict(spec)},
                    sort_keys=True,
                ),
                # With a token in it, encrypted in the stack's config like any Pulumi secret.
                secret=spec.enrollment_token is not None,
            ),
            RUNNING_KEY: auto.ConfigValue("true" if running else "false"),
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
            running = pulumi.Config("umbra").get_bool("running")
            build_dev_cvm(target, spec, running=running is not False)

        return run

    # -- the runs ----------------------------------------------------------------------------

    def launch(self, spec: DevCvmSpec, on_event: OnProvisionEvent) -> DevCvmOutputs:
        return self._up(spec, on_event, create=True)

    def update(self, spec: DevCvmSpec, on_event: OnProvisionEvent) -> DevCvmOutputs:
        """Same program with new inputs. Launch-bound data (compose, keys) replaces the VM; the
        data disk stays and is re-attached."""
        return self._up(spec, on_event, create=False)

    def set_running(self, stack: str, running: bool, on_event: OnProvisionEvent) -> None:
        """Stop or start the Dev CVM of `stack` (a ref from launch): the stack's own config holds
        the request, so only `umbra:running` changes and the launch data stays the same."""
        verb = "start" if running else "stop"
        on_event(ProvisionEvent("started", f"{verb} {stack}"))

        def run() -> Any:
            st = self._factory(stack, config_program, False)
            st.set_all_config({RUNNING_KEY: auto.ConfigValue("true" if running else "false")})
            return st.up(on_event=self._relay(on_event))

        self._attempt(f"{verb} {stack}", run, on_event)
        on_event(ProvisionEvent("finished", f"{stack} {'started' if running else 'stopped'}"))

    def destroy(self, spec: DevCvmSpec, on_event: OnProvisionEvent) -> None:
        name = self.stack_name(spec)
        on_event(ProvisionEvent("started", f"destroy {name}"))

        def run() -> Any:
            stack = self._factory(name, self.program(spec), False)
            return stack.destroy(on_event=self._relay(on_event), remove=True)

        self._attempt(f"destroy {name}", run, on_event)
        on_event(ProvisionEvent("finished", f"destroyed {name}"))

    def _up(self, spec: DevCvmSpec, on_event: OnProvisionEvent, *, create: bool) -> DevCvmOutputs:
        name = self.stack_name(spec)
        on_event(ProvisionEvent("started", f"{'launch' if create else 'update'} {name}"))

        def run() -> DevCvmOutputs:
            stack = self._factory(name, self.program(spec), create)
            stack.set_all_config(self.stack_config(spec))
            result = stack.up(on_event=self._relay(on_event))
            return _outputs(name, result.outputs)

        outputs: DevCvmOutputs = self._attempt(name, run, on_event)
        on_event(
            ProvisionEvent("finished", f"{name} is up", data={"private_ip": outputs.private_ip})
        )
        return outputs

    def _attempt(self, what: str, run: Callable[[], Any], on_event: OnProvisionEvent) -> Any:
        """Run with retries and exponential backoff for transient cloud/engine errors; the
        error that ends it is reported with its full text, not only its last line."""
        for attempt in range(1, self.attempts + 1):
            try:
                return run()
            except ProvisionerError as exc:
                on_event(ProvisionEvent("failed", str(exc)))
                raise
            except Exception as exc:
                reason = error_text(exc)
                if attempt < self.attempts and TRANSIENT.search(str(exc)):
                    delay = self.backoff_s * 2 ** (attempt - 1)
                    on_event(
                        ProvisionEvent(
                            "diagnostic",
                            f"transient failure (attempt {attempt}/{self.attempts}), "
                            f"retrying in {delay:.0f}s: {reason}",
                            data={"severity": "warning"},
                        )
                    )
                    self.sleep(delay)
                    continue
                on_event(ProvisionEvent("failed", reason))
                raise ProvisionerError(f"{what}: {reason}") from exc
        raise AssertionError("unreachable")  # pragma: no cover

    @staticmethod
    def _relay(on_event: OnProvisionEvent) -> Callable[[auto.EngineEvent], None]:
        def relay(event: auto.EngineEvent) -> None:
            mapped = translate_event(event)
            if mapped is not None:
                on_event(mapped)

        return relay

    def work_dir(self, name: str) -> Path:
        """This stack's workspace: private to this user (the stack's settings are written there),
        refused if another user owns or can write its parent."""
        root = self.work_root
        root.mkdir(mode=0o700, exist_ok=True)
        info = root.lstat()
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise ProvisionerError(
                f"{root} must be a directory owned by uid {os.getuid()} with mode 0700 "
                "(it holds the Pulumi workspaces); remove it or fix its owner and mode"
            )
        path = root / re.sub(r"[^A-Za-z0-9._-]", "_", name)
        path.mkdir(mode=0o700, exist_ok=True)
        return path

    def _local_stack(self, name: str, program: auto.PulumiFn, create: bool) -> StackLike:
        opts = auto.LocalWorkspaceOptions(
            work_dir=str(self.work_dir(name)), env_vars=self.env or None
        )
        if create:
            stack = auto.create_or_select_stack(
                name, project_name=PROJECT, program=program, opts=opts
            )
        else:
            stack = auto.select_stack(name, project_name=PROJECT, program=program, opts=opts)
        return RobustStack(stack, policy_packs=self.policy_packs, plugins=installed_plugins())


def build_dev_cvm(target: TeamTarget, spec: DevCvmSpec, *, running: bool = True) -> DevCvm:
    """The inline program body: one Dev CVM on the team network the team stack exports."""
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
            vm_name=dev_cvm_name(target.team, spec.developer, spec.cvm, Owner.CONSOLE),
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
            security_cvm_ips=team.require_output("security_cvm_ip").apply(lambda ip: [ip]),
            # The forwarder enrolls there once (the token below); a team stack from before
            # these outputs gives none, and the CVM's enrollment then fails with the reason.
            console_url=team.get_output("console_url").apply(lambda url: str(url or "")),
            console_ca=team.get_output("console_ca_pem").apply(lambda pem: str(pem or "")),
            console_ips=team.get_output("console_ips").apply(lambda ips: list(ips or [])),
            data_disk_gb=spec.data_disk_gb,
            running=running,
            enrollment_token=spec.enrollment_token,
        ),
    )
    pulumi.export("instance_id", cvm.instance_id)
    pulumi.export("private_ip", cvm.private_ip)
    pulumi.export("compose_sha256", cvm.compose_sha256)
    pulumi.export("ssh_keys_sha256", cvm.ssh_keys_sha256)
    pulumi.export("expected_events", cvm.expected_events)
    return cvm


def config_program() -> None:
    """The same program, with the request read from the stack's own config (stop/start)."""
    config = pulumi.Config("umbra")
    doc = config.require_object(DEV_CVM_KEY.split(":")[1])
    target, spec = _target_of(doc["target"]), DevCvmSpec(**doc["spec"])
    build_dev_cvm(target, spec, running=config.get_bool("running") is not False)


def _target_doc(target: TeamTarget) -> dict[str, Any]:
    return {
        "team": target.team,
        "cloud": target.cloud,
        "team_stack": target.team_stack,
        "gcp": target.gcp.model_dump() if target.gcp else None,
        "azure": target.azure.model_dump() if target.azure else None,
    }


def _target_of(doc: Mapping[str, Any]) -> TeamTarget:
    return TeamTarget(
        team=doc["team"],
        cloud=doc["cloud"],
        team_stack=doc["team_stack"],
        gcp=GcpPlacement(**doc["gcp"]) if doc.get("gcp") else None,
        azure=AzurePlacement(**doc["azure"]) if doc.get("azure") else None,
    )


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


def error_text(exc: BaseException, limit: int = 4000) -> str:
    """The whole failure, error lines first: Pulumi's last line is usually a summary, and the
    cloud's reason sits in the middle of its output."""
    if isinstance(exc, FileNotFoundError) and "pulumi" in str(exc):
        return "the Pulumi CLI is not installed on this host (`pulumi` is not on PATH)"
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    errors = [ln for ln in lines if "error" in ln.lower()]
    ordered = list(dict.fromkeys(errors + lines))
    return " | ".join(ordered)[:limit]


__all__: Sequence[str] = (
    "DevCvmOutputs",
    "DevCvmSpec",
    "OnProvisionEvent",
    "ProvisionEvent",
    "ProvisionerError",
    "PulumiDevCvmProvisioner",
    "RobustStack",
    "TeamTarget",
    "build_dev_cvm",
    "config_program",
    "error_text",
    "translate_event",
)
