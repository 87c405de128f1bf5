"""The `local` provider when `umbra up` configures it: Dev CVMs become real sandboxes on this
machine (`sandbox/local_cvm.py`), the Security CVM is the local proxy that `umbra up` supervises.

Nothing is kept in memory: every CVM's plan, pids and files live under `runtime_dir`, so a Console
restart finds them again. A Dev CVM's launch data is its one-time enrollment token; its simulated
TD enrolls before its forwarder starts (`local_cvm.enroll`), and a refusal fails the launch with
the Console's reason. Its Security CVM learns the enrolled credential's hash from the Console's
attachments document, as in the cloud: no identities file is written, no proxy restarted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError

from umbra.console.enums import CvmKind
from umbra.console.providers import (
    CvmSpec,
    OnProviderEvent,
    ProviderError,
    ProviderEvent,
    Provisioned,
)
from umbra.console.session_info import INGRESS_KEY, RELEASE_KEY
from umbra.contracts.model import Strict
from umbra.contracts.validation import first_problem
from umbra.sandbox import local_cvm


class LocalCvmSettings(Strict):
    runtime_dir: Path
    name_prefix: str = Field(default="umbra", pattern=r"^[a-z][a-z0-9]{1,8}$")
    security_cvm_port: int = Field(ge=1, le=65535)
    security_cvm_release: dict[str, Any]
    collateral_file: Path
    simulated_root: Path
    # Where the CVMs' simulated TDs enroll (the Console itself, on loopback).
    console_url: str = Field(pattern=r"^http://127\.0\.0\.1:[0-9]{1,5}$")
    # The simulated TEE the Dev CVMs' SSH ingress runs on (a `SimulatedPki` directory) and the
    # golden values the client checks its quotes against; without both, no SSH ingress.
    simulated_pki: Path | None = None
    dev_cvm_release: dict[str, Any] | None = None


def load_settings(path: Path) -> LocalCvmSettings:
    try:
        return LocalCvmSettings.model_validate_json(path.read_text())
    except OSError as exc:
        raise ProviderError(f"local_cvm_config {path}: {exc.strerror}") from None
    except ValidationError as exc:
        raise ProviderError(f"local_cvm_config {path}: {first_problem(exc)}") from None


class LocalCvmProvider:
    name = "local"
    # Run by the Console's provisioning jobs (a launch takes a second or two: namespaces, sandbox,
    # forwarder, SSH ingress), which also record `provider_state` (the SSH client's launch data).
    background = True
    resumable = False  # an interrupted local build is failed at restart, not re-run
    default_data_disk_gb: int | None = None  # the sandbox lives on this machine's disk

    def __init__(self, settings: LocalCvmSettings) -> None:
        self.settings = settings
        self.cvms = settings.runtime_dir / "cvms"

    def check(self, spec: CvmSpec) -> None:
        if spec.kind == CvmKind.dev:
            try:
                local_cvm.require_tools()
            except local_cvm.LocalCvmError as exc:
                raise ProviderError(str(exc)) from None

    def _forwarder_config(self) -> dict[str, Any]:
        s = self.settings
        return {
            "apiVersion": "umbra/v1",
            "kind": "ForwarderConfig",
            "security_cvm": {"host": "127.0.0.1", "port": s.security_cvm_port},
            "security_cvm_release": s.security_cvm_release,
            "collateral": {"file": str(s.collateral_file)},
            "allow_simulated": True,
            "simulated_root": str(s.simulated_root),
            "connect_timeout": 5,
            "handshake_timeout": 20,
            "enrollment": {
                "console_url": s.console_url,
                "quote_source": "simulated",
                "simulated_pki": str(s.simulated_pki),
                "simulated_image": local_cvm.DEV_CVM_IMAGE,
            },
        }

    def launch(self, spec: CvmSpec, on_event: OnProviderEvent) -> Provisioned:
        if spec.kind == CvmKind.security:
            # The local Security CVM is the proxy `umbra up` runs; nothing to create here.
            return Provisioned(f"local:security/{spec.id}", {"runtime": "process"})
        if spec.enrollment_token is None or self.settings.simulated_pki is None:
            raise ProviderError(
                f"local CVM {spec.id}: it cannot enroll (needs an enrollment token in its "
                "launch data and simulated_pki for its simulated TD)"
            )
        try:
            plan = local_cvm.create(
                self.cvms,
                spec.id,
                self.settings.name_prefix,
                self._forwarder_config(),
                spec.enrollment_token,
                list(spec.ssh_keys),
                self._ingress_pki(spec),
            )
        except (local_cvm.LocalCvmError, OSError) as exc:
            raise ProviderError(f"local CVM {spec.id}: {exc}") from None
        on_event(ProviderEvent("launched", f"local sandbox {plan.sandbox_ns}"))
        return Provisioned(f"local:{spec.id}", self._state(plan))

    def _ingress_pki(self, spec: CvmSpec) -> Path | None:
        """The ingress needs the simulated TEE, a release to check it against and a login key."""
        s = self.settings
        if s.simulated_pki is None or s.dev_cvm_release is None or not spec.ssh_keys:
            return None
        return s.simulated_pki

    def _state(self, plan: local_cvm.LocalCvmPlan) -> dict[str, Any]:
        """`provider_state`: what `GET /cvms/{id}/session` serves the SSH client (checked by it
        against the quote, never trusted on its own)."""
        state: dict[str, Any] = {"runtime": "namespaces", "proxy": _proxy(plan)}
        ingress = local_cvm.ssh_ingress(plan)
        if ingress is not None and self.settings.dev_cvm_release is not None:
            state[INGRESS_KEY] = ingress
            state[RELEASE_KEY] = self.settings.dev_cvm_release
        return state

    def update(self, spec: CvmSpec, ref: str, on_event: OnProviderEvent) -> Provisioned:
        plan = self._plan(spec.id, ref)
        if plan is None:
            return Provisioned(ref)
        try:
            local_cvm.write_launch_dir(plan, list(spec.ssh_keys))
            pki = self._ingress_pki(spec)
            if pki is not None:
                # A relaunch of the simulated TD: the new keys are bound into its quotes.
                local_cvm.write_ingress_config(plan, pki)
                local_cvm.restart_ingress(plan)
            else:
                local_cvm.stop(plan, "ingress")
                plan.ingress_config.unlink(missing_ok=True)
        except (local_cvm.LocalCvmError, OSError) as exc:
            raise ProviderError(f"local CVM {spec.id}: {exc}") from None
        return Provisioned(ref, self._state(plan))

    def _plan(self, cvm_id: str, ref: str) -> local_cvm.LocalCvmPlan | None:
        if ref.startswith("local:security/"):
            return None
        plan = local_cvm.load_plan(self.cvms, cvm_id)
        if plan is None:
            raise ProviderError(f"local provider has no CVM {cvm_id} on disk")
        return plan

    def set_running(self, ref: str, running: bool) -> None:
        cvm_id = ref.removeprefix("local:")
        if cvm_id.startswith("security/"):
            return
        plan = self._plan(cvm_id, ref)
        assert plan is not None
        try:
            if running:
                local_cvm.ensure_running(plan)
            else:
                for role in ("ingress", "forwarder", "sandbox"):
                    local_cvm.stop(plan, role)
        except local_cvm.LocalCvmError as exc:
            raise ProviderError(str(exc)) from None

    def destroy(self, spec: CvmSpec, ref: str | None, on_event: OnProviderEvent) -> None:
        if spec.kind != CvmKind.dev:
            return
        plan = local_cvm.load_plan(self.cvms, spec.id)
        if plan is not None:
            local_cvm.destroy(plan)


def _proxy(plan: local_cvm.LocalCvmPlan) -> str:
    return f"http://{plan.forwarder_addr}:{local_cvm.SANDBOX_PROXY_PORT}"
