"""The embedded stack's fixed names: its team and user, its components, their ports and health."""

from __future__ import annotations

from enum import IntEnum, StrEnum

TEAM = "local"
SUBJECT = "developer@umbra.local"
DEV_CVM_NAME = "dev"
SECURITY_CVM_NAME = "security"
DEMO_SECRET_NAME = "demo-token"  # noqa: S105 -- a secret's name, not its value
DEMO_HOSTS = ("api.demo.test", "evil.demo.test")
# The stand-in model API that `--check` runs the real agents against (cli/llm_origin.py).
LLM_HOST = "llm.demo.test"
# The names the stand-in origins' one certificate covers (material.py), resolved statically.
ORIGIN_NAMES = frozenset({*DEMO_HOSTS, LLM_HOST})
# Opt-in, tests only (UMBRA_UP_VENDOR_STANDINS=1, kept in the state as `vendor_standins`): the
# stand-in model API also answers as the agents' own hosts (cli/vendor_origin.py), at this
# loopback address on port 443, so `umbra connect` runs end to end against the shipped profiles.
# Never for real use: the embedded proxy then sends those names to the stand-in.
VENDOR_HOSTS = ("api.anthropic.com", "auth.openai.com", "chatgpt.com")
VENDOR_ADDR = "127.0.0.25"
VENDOR_PORT = 443
VENDOR_ENV = "UMBRA_UP_VENDOR_STANDINS"
SIMULATED_IMAGE = "umbra-security-cvm"


class Component(StrEnum):
    """The processes `umbra up` supervises, in start order (stopped in reverse)."""

    ISSUER = "issuer"
    CONSOLE = "console"
    # `--runtime qemu` only: TLS in front of the Console for the VM's enrollment (tls_front.py).
    CONSOLE_TLS = "console-tls"
    # `--runtime qemu` only: the simulated PKI's collateral the tunnel endpoint relays (up_pccs.py).
    PCCS = "pccs"
    ORIGIN = "origin"
    LLM = "llm"
    PROXY = "proxy"


COMPONENTS = tuple(Component)
# Only with `--runtime qemu` (a VM reaches the Console by TLS, and no PCCS).
QEMU_ONLY = frozenset({Component.CONSOLE_TLS, Component.PCCS})
# Only with `--runtime runc`: under qemu the Security CVM is a VM of the Console's provider.
RUNC_ONLY = frozenset({Component.PROXY})


class Port(IntEnum):
    """Each loopback port's offset from --port-base."""

    ISSUER = 0
    CONSOLE = 1
    PROXY = 2
    TUNNEL = 3  # the proxy's aTLS tunnel endpoint
    ORIGIN = 4
    LLM = 5
    CONSOLE_TLS = 6  # `--runtime qemu` only
    PCCS = 7  # `--runtime qemu` only

    @property
    def label(self) -> str:
        return self.name.lower()

    @property
    def owner(self) -> Component:
        """The component that listens on it."""
        return Component.PROXY if self is Port.TUNNEL else Component(self.label.replace("_", "-"))


# By name, as the state file, messages and tests spell them.
PORTS = {port.label: int(port) for port in Port}


class Health(StrEnum):
    """A component's or Dev CVM's state as `umbra status` shows it."""

    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"  # running, but its probe fails
    NOT_RUNNING = "not running"
    DOWN = "down"  # a Dev CVM with a process missing
