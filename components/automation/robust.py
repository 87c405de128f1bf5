"""A real Pulumi stack made safe to re-run, and which failures are worth another try."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from importlib import metadata
from typing import Any, Protocol

from pulumi import automation as auto


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
