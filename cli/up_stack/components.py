"""Each component's command line and environment, and starting it: the development issuer, the
Console, the two stand-in origins and the Security CVM (restarted when what it loads at start
changed)."""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable

from umbra.cli.up_stack.errors import UpError
from umbra.cli.up_stack.material import (
    claude_oauth_token,
    llm_keys,
    tls_identity,
    vendor_standins,
)
from umbra.cli.up_stack.names import (
    SIMULATED_IMAGE,
    SUBJECT,
    TEAM,
    VENDOR_ADDR,
    VENDOR_PORT,
    Component,
    Port,
)
from umbra.cli.up_stack.qemu import CONFIG as QEMU_CONFIG
from umbra.cli.up_stack.qemu import CONSOLE_IP, CONSOLE_NAME, Runtime, runtime, tunnel_host
from umbra.cli.up_stack.status import tcp_ok
from umbra.cli.up_stack.supervise import Stack, umbra_executable
from umbra.cli.up_stack.upstream import allowed_upstreams

# Outside the Console's settings model: a file holding the `KEK` value (console/config.py).
KEK_FILE = "kek_file"


def console_settings(stack: Stack) -> dict[str, str]:
    """The embedded Console's settings, by field name (console/config.Settings)."""
    p = stack.p
    return {
        "database_url": f"sqlite:///{p('console.db')}",
        "oidc_issuer": stack.issuer_url,
        "oidc_allow_insecure_http": "true",
        "embedded_dev": "true",
        "bundle_public_keys": str(p("keys", "dev-release.pem.pub")),
        KEK_FILE: str(p("keys", "console-kek")),
        "kek_current": "k1",
        "local_cvm_config": str(p("local-cvms.json")),
        "release_policy": str(p("security-cvm", "release.json")),
        "dev_cvm_release_policy": str(p("dev-cvm-release.json")),
        "release_collateral": str(p("pki", "collateral.json")),
        "release_allow_simulated": "true",
        "release_simulated_root": str(p("pki", "root.der")),
        "long_poll_db_interval_seconds": "0.25",
        **_runtime_settings(stack),
    }


def _runtime_settings(stack: Stack) -> dict[str, str]:
    """`--runtime qemu`: the Console launches both CVMs with its `qemu` provider (the local
    provider stays configured, the Console's default)."""
    if runtime(stack) is not Runtime.qemu:
        return {}
    return {"providers": "local,qemu", "qemu_cvm_config": str(stack.p(QEMU_CONFIG))}


def console_env(stack: Stack) -> dict[str, str]:
    """Those settings as the `UMBRA_CONSOLE_*` variables the Console reads (and checks: an
    unknown one is refused at its start)."""
    from umbra.console.config import ENV_PREFIX

    return {ENV_PREFIX + name.upper(): value for name, value in console_settings(stack).items()}


def _start(
    stack: Stack,
    component: Component,
    argv: Callable[[], list[str]],
    ready: Callable[[], None],
    env: dict[str, str] | None = None,
) -> bool:
    """Start `component` unless it runs, and wait until `ready` returns; False if it ran."""
    if stack.pid(component) is not None:
        return False
    stack.spawn(component, argv(), env)
    ready()
    return True


def start_issuer(stack: Stack) -> bool:
    def argv() -> list[str]:
        return [
            sys.executable, "-m", "umbra.console.dev_issuer",
            "--state-dir", str(stack.p("issuer")), "--subject", SUBJECT,
            "--role", f"{TEAM}:admin", "--port", str(stack.port(Port.ISSUER)),
        ]  # fmt: skip

    return _start(
        stack,
        Component.ISSUER,
        argv,
        lambda: stack.wait_http(Component.ISSUER, stack.issuer_url + "/healthz"),
    )


def start_console(stack: Stack) -> bool:
    return _start(
        stack,
        Component.CONSOLE,
        lambda: [
            umbra_executable(),
            "console",
            "serve",
            "--port",
            str(stack.port(Port.CONSOLE)),
            "--migrate",
        ],
        lambda: stack.wait_http(Component.CONSOLE, stack.console_url + "/healthz"),
        console_env(stack),
    )


def start_console_front(stack: Stack) -> bool:
    """`--runtime qemu`: TLS for the Console's name and address in front of its loopback port
    (tls_front.py), what a VM's forward reaches; its own CA (`console-tls/ca.pem`) goes into
    launch data. The Dev VM dials the name, the Security VM's proxy the address."""
    d = stack.p("console-tls")
    tls_identity(d, frozenset({CONSOLE_NAME}), frozenset({CONSOLE_IP}))

    def argv() -> list[str]:
        return [
            sys.executable, "-m", "umbra.cli.tls_front", "--cert", str(d / "origin.pem"),
            "--key", str(d / "origin-key.pem"),
            "--listen", f"127.0.0.1:{stack.port(Port.CONSOLE_TLS)}",
            "--to", f"127.0.0.1:{stack.port(Port.CONSOLE)}",
        ]  # fmt: skip

    return _start(
        stack,
        Component.CONSOLE_TLS,
        argv,
        lambda: stack.wait_tcp(Component.CONSOLE_TLS, stack.port(Port.CONSOLE_TLS), 20),
    )


def start_pccs(stack: Stack) -> bool:
    """`--runtime qemu`: the simulated PKI's collateral for the tunnel endpoint to relay."""
    argv = [sys.executable, "-m", "umbra.cli.up_pccs", "--pki", str(stack.p("pki"))]
    argv += ["--port", str(stack.port(Port.PCCS))]
    return _start(
        stack,
        Component.PCCS,
        lambda: argv,
        lambda: stack.wait_tcp(Component.PCCS, stack.port(Port.PCCS), 20),
    )


def _origin_argv(stack: Stack, module: str, port: Port, *extra: str) -> list[str]:
    """A stand-in origin: its module, the stand-ins' one certificate, its port."""
    d = stack.p("demo-origin")
    return [
        sys.executable, "-m", module, "--cert", str(d / "origin.pem"),
        "--key", str(d / "origin-key.pem"), "--port", str(stack.port(port)), *extra,
    ]  # fmt: skip


def start_origin(stack: Stack) -> bool:
    return _start(
        stack,
        Component.ORIGIN,
        lambda: _origin_argv(stack, "umbra.cli.demo_origin", Port.ORIGIN),
        lambda: stack.wait_tcp(Component.ORIGIN, stack.port(Port.ORIGIN), 20),
    )


def start_llm_origin(stack: Stack) -> bool:
    def argv() -> list[str]:
        keys = llm_keys(stack)
        # only the keys' digests: no key on a command line
        return _origin_argv(
            stack, "umbra.cli.llm_origin", Port.LLM,
            "--anthropic-key-sha256", hashlib.sha256(keys["anthropic-api-key"].encode()).hexdigest(),
            "--openai-key-sha256", hashlib.sha256(keys["openai-api-key"].encode()).hexdigest(),
            *_vendor_args(stack),
        )  # fmt: skip

    return _start(
        stack,
        Component.LLM,
        argv,
        lambda: stack.wait_tcp(Component.LLM, stack.port(Port.LLM), 20),
    )


def _vendor_args(stack: Stack) -> list[str]:
    if not vendor_standins(stack):
        return []
    digest = hashlib.sha256(claude_oauth_token(stack).encode()).hexdigest()
    return ["--vendor-listen", f"{VENDOR_ADDR}:{VENDOR_PORT}", "--claude-oauth-sha256", digest]


def wait_tunnel(stack: Stack, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if stack.pid(Component.PROXY) is None:
            raise UpError(f"proxy exited while starting: {stack.log_tail(Component.PROXY)}")
        if tcp_ok(stack.port(Port.TUNNEL), tunnel_host(stack)):
            return
        time.sleep(0.1)
    raise UpError(f"the tunnel endpoint did not listen within {timeout:.0f}s")


def _identities_hash(stack: Stack, argv: list[str]) -> str:
    """What the proxy loads only at start: the Dev CVMs it knows, the resolver map, the upstream
    CAs and its command line."""
    s = stack.p("security-cvm")
    raw = b"\0".join(
        [
            (s / name).read_bytes()
            for name in ("identities.json", "resolver.json", "upstream-ca.pem")
        ]
        + [json.dumps(argv).encode()]
    )
    return hashlib.sha256(raw).hexdigest()


def proxy_argv(stack: Stack) -> list[str]:
    s = stack.p("security-cvm")
    allow = [arg for cidr in allowed_upstreams(stack) for arg in ("--test-allow-upstream", cidr)]
    return [
        umbra_executable(), "proxy", "serve",
        # One worker: the embedded stack serves one developer, and one process starts fastest.
        "--workers", "1",
        "--listen", f"127.0.0.1:{stack.port(Port.PROXY)}",
        # Reached from each local Dev CVM's forwarder namespace over its uplink veth only (a
        # qemu VM: through its guestfwd relay on loopback).
        "--tunnel-listen", f"{tunnel_host(stack)}:{stack.port(Port.TUNNEL)}",
        "--identities", str(s / "identities.json"),
        "--traffic-log", str(s / "spool"),
        "--confdir", str(s / "mitm-ca"),
        "--console", stack.console_url,
        "--security-cvm-id", stack.state["security_cvm_id"],
        "--console-credential-file", str(s / "console-credential"),
        # Credentials only after attestation: at its first start the proxy enrolls with
        # this one-time token and keeps the sealed credential (root-only) from then on.
        "--enroll-token-file", str(s / "enrollment-token"),
        "--bundle-key", str(stack.p("keys", "dev-release.pem.pub")),
        "--state-dir", str(s / "state"),
        "--secrets-from-console",
        "--quote-source", "simulated",
        "--simulated-pki", str(stack.p("pki")),
        "--simulated-image", SIMULATED_IMAGE,
        # The system's CAs and the stand-in origin's (on loopback, embedded mode only).
        "--upstream-ca", str(s / "upstream-ca.pem"),
        *allow,
        # Real names through the system resolver, every address checked; the stand-in origin's
        # names are the one static exception.
        "--test-hosts", str(s / "resolver.json"),
        # A VM's forwarder reaches no PCCS: the tunnel endpoint sends its collateral along.
        *(["--tunnel-collateral-pccs", f"http://127.0.0.1:{stack.port(Port.PCCS)}"]
          if runtime(stack) is Runtime.qemu else []),
    ]  # fmt: skip


def start_proxy(stack: Stack) -> bool:
    """The Security CVM; restarted when what it loads only at start changed."""
    argv = proxy_argv(stack)
    current = _identities_hash(stack, argv)
    if stack.pid(Component.PROXY) is not None:
        if stack.state.get("proxy_identities") == current:
            return False
        stack.stop(Component.PROXY)
    stack.spawn(Component.PROXY, argv)
    wait_tunnel(stack, 120)
    stack.state["proxy_identities"] = current
    stack.save()
    return True
