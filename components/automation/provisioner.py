"""`PulumiDevCvmProvisioner`: launch, update, stop/start and destroy one developer's Dev CVM, one
Automation API stack each (`<team>-<developer>-<cvm>` in project `umbra-dev-cvm`), with retries
for transient failures. `stack_factory` is the seam where the `pulumi` CLI is driven."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import stat
import tempfile
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import pulumi
from pulumi import automation as auto

from umbra.components.automation.events import (
    EventKind,
    OnProvisionEvent,
    ProvisionEvent,
    relay,
)
from umbra.components.automation.program import (
    DEV_CVM_KEY,
    RUNNING_KEY,
    build_dev_cvm,
    config_program,
)
from umbra.components.automation.robust import (
    TRANSIENT,
    RobustStack,
    error_text,
    installed_plugins,
)
from umbra.components.automation.spec import (
    DevCvmOutputs,
    DevCvmSpec,
    ProvisionerError,
    TeamTarget,
)
from umbra.components.naming import Owner, dev_cvm_name

PROJECT = "umbra-dev-cvm"
# The self-managed backends and KMS secrets providers the Console stack declares.
BACKEND_URL = re.compile(
    r"^(gs://[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]"
    r"|azblob://[a-z0-9-]{3,63}(\?storage_account=[a-z0-9]{3,24})?)$"
)
SECRETS_PROVIDER = re.compile(
    r"^(gcpkms://projects/[a-z][a-z0-9-]{4,28}[a-z0-9]/locations/[a-z0-9-]+/keyRings/"
    r"[A-Za-z0-9_-]+/cryptoKeys/[A-Za-z0-9_-]+"
    r"|azurekeyvault://[A-Za-z0-9-]{3,24}\.vault\.azure\.net/keys/[A-Za-z0-9-]+)$"
)
# The policy pack every Console launch runs under (the same one team stacks use): in the Console
# image, where its environment says (images/console_tools.py copies it there); in a checkout, the
# repository's.
POLICY_PACK_ENV = "UMBRA_POLICY_PACK"
POLICY_PACK = Path(
    os.environ.get(POLICY_PACK_ENV) or Path(__file__).resolve().parents[2] / "infra" / "policy_pack"
)


class StackLike(Protocol):
    """The part of `pulumi.automation.Stack` the provisioner uses (a test double fits too)."""

    def set_all_config(self, config: MutableMapping[str, auto.ConfigValue]) -> None: ...

    def up(self, *, on_event: Callable[[auto.EngineEvent], None]) -> Any: ...

    def destroy(
        self, *, on_event: Callable[[auto.EngineEvent], None], remove: bool = ...
    ) -> Any: ...


StackFactory = Callable[[str, "pulumi.automation.PulumiFn", bool], StackLike]


def _running(running: bool) -> auto.ConfigValue:
    return auto.ConfigValue("true" if running else "false")


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
        backend_url: str | None = None,
        secrets_provider: str | None = None,
    ) -> None:
        self.target = target
        # Where every Dev CVM stack's state lives and what encrypts its secrets (the Console
        # stack declares both: infra.md "Dev CVM stacks' state"). Unset: the CLI's defaults
        # (its login, and a passphrase), which a Console replica cannot share. A backend without
        # a secrets provider is refused: the default passphrase provider would need a passphrase
        # in every replica's environment.
        if backend_url is not None and not BACKEND_URL.match(backend_url):
            raise ProvisionerError(
                f"state backend {backend_url!r} is not gs://BUCKET or azblob://CONTAINER"
            )
        if secrets_provider is not None and not SECRETS_PROVIDER.match(secrets_provider):
            raise ProvisionerError(
                f"secrets provider {secrets_provider!r} is not gcpkms://projects/… or "
                "azurekeyvault://VAULT.vault.azure.net/keys/KEY"
            )
        if (backend_url is None) != (secrets_provider is None):
            raise ProvisionerError(
                "a Dev CVM state backend and secrets provider come together (the Console "
                "stack exports both: dev_state_backend_url, dev_secrets_provider)"
            )
        self.backend_url = backend_url
        self.secrets_provider = secrets_provider
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
                    {"target": self.target.as_doc(), "spec": dataclasses.asdict(spec)},
                    sort_keys=True,
                ),
                # With a token in it, encrypted in the stack's config like any Pulumi secret.
                secret=spec.enrollment_token is not None,
            ),
            RUNNING_KEY: _running(running),
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
        on_event(ProvisionEvent(EventKind.STARTED, f"{verb} {stack}"))

        def run() -> Any:
            st = self._factory(stack, config_program, False)
            st.set_all_config({RUNNING_KEY: _running(running)})
            return st.up(on_event=relay(on_event))

        self._attempt(f"{verb} {stack}", run, on_event)
        done = "started" if running else "stopped"
        on_event(ProvisionEvent(EventKind.FINISHED, f"{stack} {done}"))

    def destroy(self, spec: DevCvmSpec, on_event: OnProvisionEvent) -> None:
        name = self.stack_name(spec)
        on_event(ProvisionEvent(EventKind.STARTED, f"destroy {name}"))

        def run() -> Any:
            stack = self._factory(name, self.program(spec), False)
            return stack.destroy(on_event=relay(on_event), remove=True)

        self._attempt(f"destroy {name}", run, on_event)
        on_event(ProvisionEvent(EventKind.FINISHED, f"destroyed {name}"))

    def _up(self, spec: DevCvmSpec, on_event: OnProvisionEvent, *, create: bool) -> DevCvmOutputs:
        name = self.stack_name(spec)
        on_event(ProvisionEvent(EventKind.STARTED, f"{'launch' if create else 'update'} {name}"))

        def run() -> DevCvmOutputs:
            stack = self._factory(name, self.program(spec), create)
            stack.set_all_config(self.stack_config(spec))
            result = stack.up(on_event=relay(on_event))
            return DevCvmOutputs.from_stack(name, result.outputs)

        outputs: DevCvmOutputs = self._attempt(name, run, on_event)
        on_event(
            ProvisionEvent(
                EventKind.FINISHED, f"{name} is up", data={"private_ip": outputs.private_ip}
            )
        )
        return outputs

    def _attempt(self, what: str, run: Callable[[], Any], on_event: OnProvisionEvent) -> Any:
        """Run with retries and exponential backoff for transient cloud/engine errors; the
        error that ends it is reported with its full text, not only its last line."""
        for attempt in range(1, self.attempts + 1):
            try:
                return run()
            except ProvisionerError as exc:
                on_event(ProvisionEvent(EventKind.FAILED, str(exc)))
                raise
            except Exception as exc:
                reason = error_text(exc)
                if attempt < self.attempts and TRANSIENT.search(str(exc)):
                    delay = self.backoff_s * 2 ** (attempt - 1)
                    on_event(
                        ProvisionEvent(
                            EventKind.DIAGNOSTIC,
                            f"transient failure (attempt {attempt}/{self.attempts}), "
                            f"retrying in {delay:.0f}s: {reason}",
                            data={"severity": "warning"},
                        )
                    )
                    self.sleep(delay)
                    continue
                on_event(ProvisionEvent(EventKind.FAILED, reason))
                raise ProvisionerError(f"{what}: {reason}") from exc
        raise AssertionError("unreachable")  # pragma: no cover

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
            work_dir=str(self.work_dir(name)),
            env_vars=self.env or None,
            project_settings=auto.ProjectSettings(
                name=PROJECT, runtime="python", backend=auto.ProjectBackend(self.backend_url)
            )
            if self.backend_url
            else None,
            secrets_provider=self.secrets_provider,
        )
        if create:
            stack = auto.create_or_select_stack(
                name, project_name=PROJECT, program=program, opts=opts
            )
        else:
            stack = auto.select_stack(name, project_name=PROJECT, program=program, opts=opts)
        return RobustStack(stack, policy_packs=self.policy_packs, plugins=installed_plugins())
