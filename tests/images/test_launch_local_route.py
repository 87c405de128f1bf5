"""A replica behind a GCP passthrough load balancer takes the balancer's address as its own.

The balancer hands the VM packets still addressed to the balancer; without Google's guest agent
(the image runs none) nothing adds the local route, the kernel does not take them as its own and
drops them. Run in network namespaces: a "fabric" namespace routes the balancer's address to the
"vm" namespace's NIC, as GCP's network does. Fails before the fix: no route, no connection."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from umbra.components.launch_data import LaunchData
from umbra.images.launch_agent import Agent, AzureUserData, LaunchError, LogOnly, Refusal
from umbra.images.launch_host import LocalRoutes
from umbra.images.measure import measure

from ..sandbox.fixtures import dev_definition, security_definition
from ..sandbox.netns import ip, namespaces, require_netns, run_in, veth
from .test_launch_agent import CONSOLE_ID, RecordingStarter, StandIn, standin

__all__ = ["standin"]

LB_IP = "10.97.1.10"
VM_IP, FABRIC_IP = "10.97.0.2", "10.97.0.1"


def _serve_once(ns: str, port_box: list[int], ready: threading.Event) -> None:
    def body() -> None:
        # Inside the test's own namespace; the balancer's address is on no NIC, so any address.
        with socket.create_server(("0.0.0.0", 0)) as server:  # noqa: S104
            port_box.append(server.getsockname()[1])
            ready.set()
            server.settimeout(5)
            try:
                conn, _ = server.accept()
            except TimeoutError:
                return
            with conn:
                conn.sendall(b"replica")

    run_in(ns, body, timeout=30)


def _connect(ns: str, port: int) -> bytes | None:
    def body() -> bytes | None:
        try:
            with socket.create_connection((LB_IP, port), timeout=2) as conn:
                return conn.recv(16)
        except OSError:
            return None

    return run_in(ns, body)


def _reaches_replica(names: dict[str, str]) -> bool:
    ports: list[int] = []
    ready = threading.Event()
    server = threading.Thread(target=_serve_once, args=(names["vm"], ports, ready), daemon=True)
    server.start()
    assert ready.wait(10)
    got = _connect(names["fabric"], ports[0])
    if got is None:  # release the listener's accept
        server.join(6)
    else:
        server.join(10)
    return got == b"replica"


@pytest.fixture
def network() -> dict[str, str]:
    require_netns()
    with namespaces("fabric", "vm") as names:
        veth(names["fabric"], "fab0", f"{FABRIC_IP}/24", names["vm"], "eth0", f"{VM_IP}/24")
        ip("-n", names["vm"], "route", "add", "default", "via", FABRIC_IP)
        # GCP's fabric delivers the balancer's packets to the backend VM, destination unchanged.
        ip("-n", names["fabric"], "route", "add", f"{LB_IP}/32", "via", VM_IP)
        yield names


def test_a_security_replica_accepts_the_balancers_packets(
    standin: StandIn, tmp_path: Path, network: dict[str, str]
) -> None:
    assert not _reaches_replica(network)  # the image without the route: dropped
    data = LaunchData(
        role="security-cvm",
        team="team-a",
        cvm_id=CONSOLE_ID,
        app_compose=measure(security_definition()).app_compose.decode(),
        lb_ip=LB_IP,
    )
    standin.user_data = data.azure_user_data()
    lines: list[str] = []
    Agent(
        AzureUserData(standin.url), LogOnly(), RecordingStarter(), None, tmp_path / "launch",
        lines.append, local_routes=LocalRoutes(("ip", "-n", network["vm"])),
    ).run()  # fmt: skip
    assert f"umbra-launch: load balancer address {LB_IP} is local" in lines
    assert f"local {LB_IP} dev lo" in ip("-n", network["vm"], "route", "show", "table", "local")
    assert _reaches_replica(network)
    # Idempotent: a restarted agent (reboot without a fresh namespace) replaces, never fails.
    LocalRoutes(("ip", "-n", network["vm"])).add(LB_IP)


def test_a_dev_cvm_with_a_balancer_address_is_refused(standin: StandIn, tmp_path: Path) -> None:
    data = LaunchData(
        role="dev-cvm",
        team="team-a",
        cvm_id=CONSOLE_ID,
        app_compose=measure(dev_definition()).app_compose.decode(),
        ssh_authorized_keys=(
            "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl a",
        ),
        lb_ip=LB_IP,
    )
    standin.user_data = data.azure_user_data()
    lines: list[str] = []
    starter = RecordingStarter()
    agent = Agent(
        AzureUserData(standin.url), LogOnly(), starter, None, tmp_path / "l", lines.append
    )
    with pytest.raises(LaunchError) as exc:
        agent.run()
    assert exc.value.reason is Refusal.INVALID and "umbra-lb-ip" in lines[-1]
    assert len(lines) == 1
