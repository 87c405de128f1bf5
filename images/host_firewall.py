"""Host firewall of a Dev CVM: the sandbox's bridge reaches nothing on the host.

Docker's `internal: true` drops forwarding off the bridge, but the host itself still answers on
the bridge's gateway address (INPUT), so any host service listening on 0.0.0.0 would be reachable
from the sandbox. These rules drop everything that enters from the sandbox's bridge toward the
host or elsewhere; only the forwarder, which also sits on the uplink, talks to the Security CVM. Rules are inserted first in INPUT and FORWARD (ahead of Docker's own) and are
idempotent: `-C` before `-I`, and removal takes out exactly what was added.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

# The bridges the rendered Dev CVM compose names (com.docker.network.bridge.name).
SANDBOX_BRIDGES = ("umbra-sbx0",)


class FirewallError(Exception):
    pass


def rules(bridge: str) -> list[list[str]]:
    return [
        ["INPUT", "-i", bridge, "-j", "DROP"],
        ["FORWARD", "-i", bridge, "-j", "DROP"],
    ]


def _iptables(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["iptables", "-w", "10", *args], capture_output=True, text=True)


def apply(bridges: Sequence[str] = SANDBOX_BRIDGES) -> None:
    for bridge in bridges:
        for rule in rules(bridge):
            if _iptables("-C", *rule).returncode == 0:
                continue
            done = _iptables("-I", rule[0], "1", *rule[1:])
            if done.returncode != 0:
                raise FirewallError(f"iptables -I {' '.join(rule)}: {done.stderr.strip()}")


def remove(bridges: Sequence[str] = SANDBOX_BRIDGES) -> None:
    for bridge in bridges:
        for rule in rules(bridge):
            while _iptables("-C", *rule).returncode == 0:
                _iptables("-D", *rule)
