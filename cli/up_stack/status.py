"""`umbra status` and `umbra down`: each component's health probe, each Dev CVM's processes."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import httpx

from umbra.cli.up_stack import qemu, vms
from umbra.cli.up_stack.names import COMPONENTS, Component, Health, Port
from umbra.cli.up_stack.supervise import Stack
from umbra.sandbox import local_cvm


def down(stack: Stack) -> list[str]:
    # The VMs first, while the Console that launched them still runs: the power button, then a
    # kill after the grace period (stopping the Console would take them down unannounced).
    stopped = vms.stop_vms(stack)
    stopped += [str(name) for name in reversed(COMPONENTS) if stack.stop(name)]
    for plan in local_cvm.all_plans(stack.p("cvms")):
        local_cvm.shut_down(plan)
        stopped.append(f"dev-cvm {plan.cvm_id}")
    return stopped


def status(stack: Stack) -> dict[str, Any]:
    out: dict[str, Any] = {"state_dir": str(stack.state_dir), "components": {}}
    on_qemu = qemu.runtime(stack) is qemu.Runtime.qemu
    probes: dict[Component, Callable[[], bool]] = {
        Component.ISSUER: lambda: http_ok(stack.issuer_url + "/healthz"),
        Component.CONSOLE: lambda: http_ok(stack.console_url + "/healthz"),
        Component.ORIGIN: lambda: tcp_ok(stack.port(Port.ORIGIN)),
        Component.LLM: lambda: tcp_ok(stack.port(Port.LLM)),
        Component.PROXY: lambda: tcp_ok(stack.port(Port.TUNNEL), qemu.tunnel_host(stack)),
        Component.CONSOLE_TLS: lambda: tcp_ok(stack.port(Port.CONSOLE_TLS)),
        Component.PCCS: lambda: http_ok(
            f"http://127.0.0.1:{stack.port(Port.PCCS)}/sgx/certification/v4/rootcacrl"
        ),
    }
    for name in qemu.components(stack):
        pid = stack.pid(name)
        out["components"][str(name)] = {
            "pid": pid,
            "running": pid is not None,
            "healthy": pid is not None and probes[name](),
        }
    out["console_url"] = stack.console_url
    out["runtime"] = str(qemu.runtime(stack))
    out["dev_cvms"] = vms.status(stack) if on_qemu else []
    # Under qemu the Security CVM is a VM too (under runc: the `proxy` component).
    out["security_cvms"] = vms.status(stack, "security_cvm_id") if on_qemu else []
    for plan in local_cvm.all_plans(stack.p("cvms")):
        info = local_cvm.status(plan)
        info["healthy"] = bool(
            info["sandbox_pid"]
            and info["forwarder_pid"]
            and (info["ssh_ingress"] is None or info["ingress_pid"])
        )
        out["dev_cvms"].append(info)
    return out


def component_health(report: dict[str, Any]) -> Health:
    """One component's entry of `status()` as the table shows it."""
    if report["healthy"]:
        return Health.HEALTHY
    return Health.UNHEALTHY if report["running"] else Health.NOT_RUNNING


def http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def tcp_ok(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), 1):
            return True
    except OSError:
        return False
