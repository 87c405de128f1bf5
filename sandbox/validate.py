"""Structural checks on a rendered compose file, parsed back from its bytes.

The template is trusted no more than its inputs: whatever produced the YAML, these rules decide
whether it may be shipped. Every violation is collected and reported together.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable
from typing import Any

import yaml

from umbra.sandbox.models import check_image_ref


class ComposeError(Exception):
    """A compose file breaks an isolation rule; `problems` lists each one."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("compose file refused:\n  - " + "\n  - ".join(problems))


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML keeps the last of two equal keys; a second `internal:` must not win silently."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return dict(loader.construct_mapping(node))


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)

TOP_KEYS = {"name", "services", "networks", "volumes", "configs"}
SERVICE_KEYS = {
    "image", "runtime", "hostname", "restart", "init", "networks", "environment", "volumes",
    "command", "user", "read_only", "cap_drop", "cap_add", "security_opt", "ports", "configs",
    "tmpfs",
}  # fmt: skip
# Named here so the error says why, not just "unknown key".
FORBIDDEN_SERVICE_KEYS = {
    "privileged": "privileged containers are never allowed",
    "network_mode": "network_mode (host or another container's stack) bypasses the topology",
    "pid": "sharing a PID namespace is not allowed",
    "ipc": "sharing an IPC namespace is not allowed",
    "userns_mode": "userns_mode would undo user-namespace isolation",
    "devices": "host devices are not allowed",
    "extra_hosts": "extra_hosts is not allowed",
    "dns": "custom DNS servers are not allowed",
    "sysctls": "sysctls are not allowed",
    "volumes_from": "volumes_from is not allowed",
    "links": "links are not allowed",
    "external_links": "external_links are not allowed",
    "cgroup_parent": "cgroup_parent is not allowed",
    "build": "images are pulled by digest, never built at launch",
}
NETWORK_KEYS = {"driver", "internal", "enable_ipv6", "ipam", "driver_opts"}
# Only the bridge's name may be set (no other driver option changes isolation).
BRIDGE_NAME_OPT = "com.docker.network.bridge.name"
LAUNCH_PREFIX = "/run/umbra/launch/"
# The Security CVM's unshipped traffic records live on its data disk (the launch agent mounts it
# and creates this directory, owned by the proxy's uid): a reboot keeps them for the shipper.
SPOOL_DIR = "/var/lib/umbra/data/spool"
SPOOL_VOLUME = {
    "driver": "local",
    "driver_opts": {"type": "none", "o": "bind", "device": SPOOL_DIR},
}
# The Security CVM's quote interface (configfs-tsm): the one writable host path, and only there.
TSM_REPORT = "/sys/kernel/config/tsm/report"
UNSAFE_SECURITY_OPTS = ("unconfined", "label=disable", "label:disable")


def load_compose(text: str) -> dict[str, Any]:
    try:
        doc = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 -- a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ComposeError([f"not valid YAML: {exc}"]) from None
    if not isinstance(doc, dict):
        raise ComposeError(["top level must be a mapping"])
    return doc


def _mapping(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def service_networks(svc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    nets = svc.get("networks", {})
    if isinstance(nets, list):
        return {str(n): {} for n in nets}
    return {str(k): _mapping(v) for k, v in _mapping(nets).items()}


def _common(
    doc: dict[str, Any],
    caps: dict[str, set[str]],
    out: list[str],
    host_paths: frozenset[str],
    binds: tuple[str, dict[str, Any]],
) -> None:
    """`binds`: the one named volume this role may bind to its data disk, and exactly how."""
    for key in sorted(set(doc) - TOP_KEYS):
        out.append(f"top-level key {key!r} is not allowed")
    services = _mapping(doc.get("services"))
    networks = _mapping(doc.get("networks"))
    volumes = _mapping(doc.get("volumes"))
    if not services:
        out.append("no services")
    for name, raw in volumes.items():
        # A volume definition can bind any host path (driver_opts), around the host-path rule
        # below: only plain volumes, and the workspace's one bind, are allowed.
        bind_name, bind = binds
        if raw not in ({}, None) and not (name == bind_name and raw == bind):
            device = bind["driver_opts"]["device"]
            out.append(
                f"volume {name}: only a plain volume ({{}}) is allowed"
                + (f" (the {name} may bind exactly {device})" if name == bind_name else "")
            )
    for name, raw in networks.items():
        net = _mapping(raw)
        for key in sorted(set(net) - NETWORK_KEYS):
            out.append(f"network {name}: key {key!r} is not allowed (external networks included)")
        for opt in sorted(set(_mapping(net.get("driver_opts"))) - {BRIDGE_NAME_OPT}):
            out.append(f"network {name}: driver_opts {opt!r} is not allowed")
        if net.get("driver") != "bridge":
            out.append(f"network {name}: driver must be bridge")
        if net.get("enable_ipv6") is not False:
            out.append(f"network {name}: enable_ipv6 must be false (the topology is IPv4-only)")
    for name, raw in services.items():
        svc = _mapping(raw)
        where = f"service {name}"
        for key in sorted(set(svc) - SERVICE_KEYS):
            out.append(f"{where}: {FORBIDDEN_SERVICE_KEYS.get(key, f'key {key!r} is not allowed')}")
        try:
            check_image_ref(str(svc.get("image", "")))
        except ValueError as exc:
            out.append(f"{where}: {exc}")
        nets = service_networks(svc)
        if not nets:
            out.append(f"{where}: must name its networks explicitly")
        for net_name in nets:
            if net_name not in networks:
                out.append(f"{where}: network {net_name!r} is not declared")
        for cap in svc.get("cap_add", []) or []:
            if str(cap) not in caps.get(name, set()):
                out.append(f"{where}: cap_add {cap} is not allowed for this service")
        for opt in svc.get("security_opt", []) or []:
            if any(bad in str(opt) for bad in UNSAFE_SECURITY_OPTS):
                out.append(f"{where}: security_opt {opt!r} disables a protection")
        for vol in svc.get("volumes", []) or []:
            _check_volume(where, vol, volumes, out, host_paths)
        for port in svc.get("ports", []) or []:
            if not str(port).endswith("/tcp"):
                out.append(f"{where}: port {port!r} must be TCP and say so (/tcp)")


def _check_volume(
    where: str,
    vol: Any,
    volumes: dict[str, Any],
    out: list[str],
    host_paths: frozenset[str] = frozenset(),
) -> None:
    if not isinstance(vol, str):
        out.append(f"{where}: volume {vol!r} must use the short string form")
        return
    parts = vol.split(":")
    src = parts[0]
    if "docker.sock" in vol:
        out.append(f"{where}: mounting the Docker socket is root on the host")
    elif src in host_paths:
        if parts[1:2] != [src]:
            out.append(f"{where}: {src} must be mounted at the same path")
    elif src.startswith("/"):
        if not src.startswith(LAUNCH_PREFIX) or ".." in src:
            out.append(f"{where}: host path {src} is not under {LAUNCH_PREFIX}")
        elif len(parts) != 3 or parts[2] != "ro":
            out.append(f"{where}: launch material {src} must be mounted read-only (:ro)")
    elif src not in volumes:
        out.append(f"{where}: named volume {src!r} is not declared")


def _members(services: dict[str, Any], network: str) -> set[str]:
    return {n for n, s in services.items() if network in service_networks(_mapping(s))}


def _exact(what: str, actual: Iterable[str], expected: set[str], out: list[str]) -> None:
    got = set(actual)
    if got != expected:
        out.append(f"{what} must be exactly {sorted(expected)}, got {sorted(got)}")


def _run(text: str, check: Callable[[dict[str, Any], list[str]], None]) -> dict[str, Any]:
    doc = load_compose(text)
    problems: list[str] = []
    check(doc, problems)
    if problems:
        raise ComposeError(problems)
    return doc


def _flag(command: list[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if command[:-1].count(flag) == 1 else None


def _security(doc: dict[str, Any], out: list[str]) -> None:
    _common(doc, {}, out, frozenset({TSM_REPORT}), ("spool", SPOOL_VOLUME))
    if _mapping(doc.get("volumes")).get("spool") != SPOOL_VOLUME:
        # Unshipped traffic records on tmpfs would be lost by every reboot.
        out.append(f"volume spool must bind the data disk's {SPOOL_DIR} (exactly)")
    services = _mapping(doc.get("services"))
    networks = _mapping(doc.get("networks"))
    _exact("services", services, {"proxy"}, out)
    _exact("networks", networks, {"edge"}, out)
    for name, svc in services.items():
        if "runtime" in _mapping(svc):
            out.append(f"service {name}: no runtime override on the Security CVM")
    proxy = _mapping(services.get("proxy"))
    command = [str(c) for c in proxy.get("command", []) or []]
    if command[:3] != ["umbra", "proxy", "serve"]:
        out.append("service proxy: command must be `umbra proxy serve`")
    # The proxy listener must be loopback: only the tunnel endpoint (same process) may reach it,
    # since it is what attributes each connection to an authenticated tunnel.
    listen = _flag(command, "--listen") or ""
    host = listen.rpartition(":")[0]
    try:
        loopback = ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        out.append("service proxy: --listen must be a loopback address")
    tunnel = _flag(command, "--tunnel-listen")
    if tunnel is None:
        out.append("service proxy: needs exactly one --tunnel-listen")
    _check_quote_source(command, proxy, out)
    tunnel_port = (tunnel or "").rpartition(":")[2]
    ports = [str(p) for p in proxy.get("ports", []) or []]
    if ports != [f"{tunnel_port}:{tunnel_port}/tcp"]:
        out.append("service proxy: it publishes only the tunnel endpoint's port")


# Only a simulated release may carry these (the proxy warns loudly; production verifiers refuse
# the simulated root, so such a release never attests as production).
SIMULATED_ONLY_FLAGS = ("--simulated-pki", "--tdx-quote-socket", "--test-allow-upstream", "--test-resolver", "--test-hosts",
                        "--upstream-ca", "--policy-dir", "--bundle", "--secrets")  # fmt: skip


def _check_quote_source(command: list[str], proxy: dict[str, Any], out: list[str]) -> None:
    source = _flag(command, "--quote-source")
    tsm = any(str(v).startswith(TSM_REPORT) for v in proxy.get("volumes", []) or [])
    if source == "configfs":
        for flag in SIMULATED_ONLY_FLAGS:
            if flag in command:
                out.append(f"service proxy: {flag} only in a simulated release")
        if not tsm:
            out.append(f"service proxy: --quote-source configfs needs {TSM_REPORT} mounted")
    elif source == "simulated":
        # The simulator's PKI comes with the launch material, read-only; no TD interface.
        if not (_flag(command, "--simulated-pki") or "").startswith(LAUNCH_PREFIX):
            out.append("service proxy: --simulated-pki must be in the launch directory")
        if tsm:
            out.append(f"service proxy: a simulated release does not mount {TSM_REPORT}")
    elif source == "emulated":
        # The emulated clouds' host TDX module, through the agent's relay socket in the launch
        # directory (read-only bind; quotes only). Simulated root: never production.
        if not (_flag(command, "--tdx-quote-socket") or "").startswith(LAUNCH_PREFIX):
            out.append("service proxy: --tdx-quote-socket must be in the launch directory")
        if tsm:
            out.append(f"service proxy: an emulated release does not mount {TSM_REPORT}")
    else:
        out.append("service proxy: the Security CVM quotes with --quote-source configfs "
                   "(or simulated or emulated, in a simulated release)")  # fmt: skip


def validate_security_compose(text: str) -> dict[str, Any]:
    return _run(text, _security)
