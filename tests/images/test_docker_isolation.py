"""The sandbox's network under a real Docker engine (Debian's docker.io, started by
scripts/docker-up), with the built runtime image and the host firewall of images.host_firewall.

A container on an `internal` bridge (the Dev CVM's old compose layout put its sandbox there; the
Dev CVM now runs the runc topology of sandbox/dev_host.py, and these bridge rules guard any
internal Docker network): nothing leaves the bridge, DNS is dead (Docker 20.10 still installs a
default route via the gateway). Without the host rules the bridge's gateway (the host) answers:
the test shows that hole first, then that the rules close it for TCP and UDP.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from umbra.images import host_firewall
from umbra.images.measure import measure
from umbra.images.os_image import OS_DIR, load_os_definition
from umbra.sandbox.validate import ComposeError, validate_security_compose

from ..sandbox.fixtures import security_definition
from .conftest import docker_up

pytestmark = pytest.mark.timeout(1500)

PROBE = r"""
import json, socket, sys
gw, tcp_port, udp_port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
out = {}
def tcp(host, port):
    s = socket.socket(); s.settimeout(3)
    try:
        s.connect((host, port)); data = s.recv(64); return data.decode() or "connected"
    except OSError as e:
        return f"error:{e.errno}:{type(e).__name__}"
    finally:
        s.close()
out["gateway_tcp"] = tcp(gw, tcp_port)
out["internet_tcp"] = tcp("1.1.1.1", 443)
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.settimeout(3)
try:
    u.sendto(b"probe", (gw, udp_port)); out["gateway_udp"] = u.recv(64).decode()
except OSError as e:
    out["gateway_udp"] = f"error:{type(e).__name__}"
try:
    out["dns"] = str(socket.getaddrinfo("deb.debian.org", 443)[0][4])
except OSError as e:
    out["dns"] = f"error:{type(e).__name__}"
routes = open("/proc/net/route").read().splitlines()[1:]
out["default_route"] = any(r.split()[1] == "00000000" for r in routes)
print(json.dumps(out))
"""


@pytest.fixture
def host_services() -> Iterator[tuple[int, int, list[bytes]]]:
    """A TCP and a UDP service on all host addresses: what a careless host daemon looks like."""
    tcp = socket.create_server(("0.0.0.0", 0))  # noqa: S104 -- the point of the test
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("0.0.0.0", 0))  # noqa: S104
    udp.settimeout(0.5)
    got: list[bytes] = []
    stop = threading.Event()

    def serve_tcp() -> None:
        tcp.settimeout(0.5)
        while not stop.is_set():
            try:
                conn, _ = tcp.accept()
            except OSError:
                continue
            conn.sendall(b"host-service")
            conn.close()

    def serve_udp() -> None:
        while not stop.is_set():
            try:
                data, addr = udp.recvfrom(64)
            except OSError:
                continue
            got.append(data)
            udp.sendto(b"host-udp", addr)

    threads = [threading.Thread(target=f, daemon=True) for f in (serve_tcp, serve_udp)]
    for t in threads:
        t.start()
    try:
        yield tcp.getsockname()[1], udp.getsockname()[1], got
    finally:
        stop.set()
        for t in threads:
            t.join(5)
        tcp.close()
        udp.close()


def _docker(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=300)
    if check and done.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)}: {done.stderr.strip()}")
    return done


def _probe(image: str, net: str, gw: str, tcp: int, udp: int) -> dict[str, Any]:
    done = _docker(
        "run", "--rm", "--runtime", "runc", "--network", net, "--user", "65534:65534",
        "--entrypoint", "/opt/python/bin/python3.12", image, "-c", PROBE, gw, str(tcp), str(udp),
    )  # fmt: skip
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_sandbox_bridge_reaches_nothing_with_the_host_firewall(
    runtime_builds: tuple[Path, dict[str, dict[str, str]], dict[str, dict[str, str]]],
    host_services: tuple[int, int, list[bytes]],
) -> None:
    docker_up()
    out, images, _ = runtime_builds
    fwd = images["proxy"]
    _docker("load", "-i", str(out / fwd["archive"]))
    tag = f"umbra/proxy:{fwd['config_digest'][7:19]}"
    pid = os.getpid()
    net, bridge = f"uim-{pid}-sandbox", f"uim{pid % 100000}s"
    subnet_octet = 100 + pid % 100
    gw = f"10.231.{subnet_octet}.1"
    tcp, udp, got = host_services
    try:
        _docker(
            "network", "create", "--internal", "--subnet", f"10.231.{subnet_octet}.0/24",
            "--gateway", gw, "-o", f"com.docker.network.bridge.name={bridge}", net,
        )  # fmt: skip
        before = _probe(fwd["config_digest"], net, gw, tcp, udp)
        print("without host rules:", before)
        # The hole the host rules exist for: internal networks still reach the host itself.
        assert before["gateway_tcp"] == "host-service"
        # Docker 20.10 gives internal-network containers a default route via the gateway (and
        # root in the sandbox may add one anyway): what holds is that nothing is forwarded.
        assert before["internet_tcp"].startswith("error:")
        assert before["dns"].startswith("error:")
        host_firewall.apply([bridge])
        got.clear()
        after = _probe(fwd["config_digest"], net, gw, tcp, udp)
        print("with host rules:", after)
        assert after["gateway_tcp"].startswith("error:")
        assert after["gateway_udp"].startswith("error:") and got == []
        assert after["internet_tcp"].startswith("error:")
        assert after["dns"].startswith("error:")
    finally:
        host_firewall.remove([bridge])
        _docker("network", "rm", net, check=False)
        _docker("rmi", "-f", tag, check=False)


def test_cve_2024_29018_path_stays_closed_by_configuration() -> None:
    """Docker < 26 (CI's Debian docker.io is 20.10) may forward DNS for containers on internal
    networks from the host's namespace when the upstream resolver is on loopback
    (CVE-2024-29018). The CVM never has such an upstream: compose `dns` is refused by the
    validator, the OS images carry no local resolver, the launch agent refuses loopback
    resolvers (tests/images/test_launch_host.py). The Dev CVM's sandbox is not a container at
    all: its resolver is the forwarder's (tests/images/test_dev_host.py)."""
    with pytest.raises(ComposeError, match="custom DNS servers are not allowed"):
        validate_security_compose(_with_dns(measure(security_definition()).compose.text))
    for name in ("gcp.yaml", "azure.yaml", "qemu.yaml"):
        packages = set(load_os_definition(OS_DIR / name).packages)
        assert not packages & {"systemd-resolved", "dnsmasq", "unbound", "bind9"}, name


def _with_dns(compose: str) -> str:
    return compose.replace(
        "    restart: unless-stopped\n", "    restart: unless-stopped\n    dns: [127.0.0.1]\n", 1
    )
