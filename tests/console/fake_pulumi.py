"""A stand-in for the Pulumi CLI behind the provisioner's `stack_factory` (the CLI is not
installed here): stacks keyed by name, engine events, outputs, and per-CVM gates and failures."""

from __future__ import annotations

import threading
from collections.abc import Callable, MutableMapping
from typing import Any

from pulumi import automation as auto

INSTANCE = "gcp:compute/instance:Instance"


def _event(seq: int, **kw: Any) -> auto.EngineEvent:
    return auto.EngineEvent(sequence=seq, timestamp=0, **kw)


def _step(op: auto.OpType) -> auto.StepEventMetadata:
    return auto.StepEventMetadata(
        op=op, urn=f"urn:pulumi:s::p::{INSTANCE}::x", type=INSTANCE, provider=""
    )


class FakeClouds:
    def __init__(self) -> None:
        self.stacks: dict[str, FakeStack] = {}
        self.gates: dict[str, threading.Event] = {}  # stack-name suffix -> hold `up` until set
        self.fail_up: dict[str, str] = {}  # stack-name suffix -> error text
        self.fail_destroy: dict[str, str] = {}
        self.no_cli: set[str] = set()  # stack-name suffixes for which `pulumi` is "not on PATH"
        self.lock = threading.Lock()
        self.ips = 0

    def factory(self, name: str, program: Any, create: bool) -> FakeStack:
        if create and any(name.endswith(suffix) for suffix in self.no_cli):
            raise FileNotFoundError(2, "No such file or directory: 'pulumi'")
        with self.lock:
            if name not in self.stacks:
                if not create:
                    raise auto.StackNotFoundError(
                        auto.CommandResult("", f"no stack named '{name}' found", 255)
                    )
                self.stacks[name] = FakeStack(self, name)
            return self.stacks[name]

    def _match(self, table: dict[str, Any], name: str) -> Any:
        for suffix, value in table.items():
            if name.endswith(suffix):
                return value
        return None


class FakeStack:
    def __init__(self, clouds: FakeClouds, name: str) -> None:
        self.clouds, self.name = clouds, name
        self.config: dict[str, str] = {}
        self.secret_keys: set[str] = set()
        self.ups = 0

    def set_all_config(self, config: MutableMapping[str, auto.ConfigValue]) -> None:
        self.config = {key: value.value for key, value in config.items()}
        self.secret_keys = {key for key, value in config.items() if value.secret}

    def up(self, *, on_event: Callable[[auto.EngineEvent], None]) -> Any:
        on_event(_event(1, resource_pre_event=auto.ResourcePreEvent(_step(auto.OpType.CREATE))))
        on_event(_event(2, diagnostic_event=auto.DiagnosticEvent("quota is low\n", "", "warning")))
        gate = self.clouds._match(self.clouds.gates, self.name)
        if gate is not None:
            assert gate.wait(30), "test gate never opened"
        failure = self.clouds._match(self.clouds.fail_up, self.name)
        if failure is not None:
            raise RuntimeError(failure)
        on_event(_event(3, res_outputs_event=auto.ResOutputsEvent(_step(auto.OpType.CREATE))))
        self.ups += 1
        with self.clouds.lock:
            self.clouds.ips += 1
            ip = f"10.20.0.{self.clouds.ips}"
        out = {
            "instance_id": f"{self.name}-vm",
            "private_ip": ip,
            "compose_sha256": "c" * 64,
            "ssh_keys_sha256": f"{self.ups:064x}",
            "expected_events": {"compose-hash": "c" * 64},
        }
        values = {key: auto.OutputValue(value, False) for key, value in out.items()}
        return auto.UpResult("", "", None, values)  # type: ignore[arg-type]

    def destroy(self, *, on_event: Callable[[auto.EngineEvent], None], remove: bool = False) -> Any:
        on_event(_event(4, resource_pre_event=auto.ResourcePreEvent(_step(auto.OpType.DELETE))))
        failure = self.clouds._match(self.clouds.fail_destroy, self.name)
        if failure is not None:
            raise RuntimeError(failure)
        with self.clouds.lock:
            self.clouds.stacks.pop(self.name, None)
