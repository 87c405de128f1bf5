"""The Dev CVM host ruleset, loaded with real nft into a network namespace that stands in for the
VM, with namespaces for the forwarder (its uplink /30, as sandbox/dev_host.py makes it), a source
on the sandbox's /30 (which in the runc topology never reaches the host: here it does, to show
the host drops it anyway) and the cloud network (Security CVM, the Console, another host, the
internet, the metadata server's DNS). Only the forwarder reaches the Security CVM's tunnel port
and the Console's 443 (its one enrollment), masqueraded to the VM's address; DNS to the metadata
server is dropped from everywhere."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from umbra.components.host_firewall import TABLE, HostFirewall, render_host_ruleset
from umbra.components.launch_data import LaunchData
from umbra.components.ports import DEV_UPLINK_CIDR
from umbra.sandbox.dev_definition import network

SEC, OTHER, WEB, META = "10.20.1.10", "10.20.1.11", "203.0.113.5", "169.254.169.254"
WIRE = "168.63.129.16"  # Azure's wire server: the launch agent's Ready report
CON = "10.20.1.20"
VM_IP = "10.20.0.5"
# The measured runc topology's addresses (index 1): forwarder uplink, host end, sandbox.
FWD_IP, UPLINK_HOST, SBX_IP = network(1).uplink, network(1).host, network(1).sandbox
SBX_GW = network(1).forwarder

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("nft") is None or shutil.which("ip") is None,
    reason="LOUD SKIP: needs root, nft (Debian nftables) and ip to build network namespaces",
)

SERVER = textwrap.dedent(
    """
    import socket, sys, threading
    def tcp(host, port):
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port)); s.listen(16)
        while True:
            c, _ = s.accept(); c.sendall(b"ok"); c.close()
    def peer(host, port):
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port)); s.listen(16)
        while True:
            c, addr = s.accept(); c.sendall(addr[0].encode()); c.close()
    def udp(host, port):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind((host, port))
        while True:
            data, peer = s.recvfrom(512); s.sendto(b"ok", peer)
    for kind, host, port in [tuple(x.split(":")) for x in sys.argv[1:]]:
        target = {"tcp": tcp, "udp": udp, "peer": peer}[kind]
        threading.Thread(target=target, args=(host, int(port)), daemon=True).start()
    print("ready", flush=True)
    threading.Event().wait()
    """
)

PROBE = textwrap.dedent(
    """
    import json, socket, sys
    from concurrent.futures import ThreadPoolExecutor
    def one(spec):
        kind, host, port = spec.split(":")
        try:
            if kind == "tcp":
                s = socket.create_connection((host, int(port)), timeout=0.6)
                return s.recv(2) == b"ok"
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(0.6)
            s.sendto(b"q", (host, int(port))); return s.recv(2) == b"ok"
        except OSError:
            return False
    with ThreadPoolExecutor(len(sys.argv)) as pool:
        print(json.dumps(dict(zip(sys.argv[1:], pool.map(one, sys.argv[1:])))))
    """
)


def sh(*args: str) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout


class Lab:
    def __init__(self, tag: str) -> None:
        self.ns = {k: f"{tag}{k}" for k in ("v", "f", "s", "n")}
        self.procs: list[subprocess.Popen[str]] = []
        self.ruleset = Path("/nonexistent")

    def ex(self, ns: str, *args: str) -> str:
        return sh("ip", "netns", "exec", self.ns[ns], *args)

    def link(self, a: str, b: str, a_addr: str, b_addr: str) -> None:
        ia, ib = f"{self.ns[a]}{b}", f"{self.ns[b]}{a}"
        sh(
            "ip",
            "link",
            "add",
            ia,
            "netns",
            self.ns[a],
            "type",
            "veth",
            "peer",
            ib,
            "netns",
            self.ns[b],
        )
        self.ex(a, "ip", "addr", "add", a_addr, "dev", ia)
        self.ex(b, "ip", "addr", "add", b_addr, "dev", ib)
        self.ex(a, "ip", "link", "set", ia, "up")
        self.ex(b, "ip", "link", "set", ib, "up")

    def up(self) -> None:
        for ns in self.ns.values():
            sh("ip", "netns", "add", ns)
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        self.link("v", "n", f"{VM_IP}/24", "10.20.0.1/24")
        self.link("v", "f", f"{UPLINK_HOST}/30", f"{FWD_IP}/30")
        self.link("v", "s", f"{SBX_GW}/30", f"{SBX_IP}/30")
        for addr in (SEC, OTHER, WEB, META, CON, WIRE):
            self.ex("n", "ip", "addr", "add", f"{addr}/32", "dev", "lo")
        # The cloud network could route replies back to the private /30s: only the masquerade
        # shows which source the Security CVM sees.
        self.ex("n", "ip", "route", "add", "10.231.0.0/16", "via", VM_IP)
        self.ex("n", "ip", "route", "add", "10.232.0.0/16", "via", VM_IP)
        self.ex("v", "ip", "route", "add", "default", "via", "10.20.0.1")
        self.ex("f", "ip", "route", "add", "default", "via", UPLINK_HOST)
        self.ex("s", "ip", "route", "add", "default", "via", SBX_GW)
        self.ex("v", "sysctl", "-qw", "net.ipv4.ip_forward=1")
        self.serve(
            "n",
            f"tcp:{SEC}:8443",
            f"tcp:{SEC}:9000",
            f"tcp:{OTHER}:8443",
            f"tcp:{WEB}:443",
            f"udp:{META}:53",
            f"tcp:{META}:53",
            f"udp:{SEC}:53",
            f"tcp:{META}:80",
            f"tcp:{CON}:443",
            f"tcp:{CON}:8443",
            f"tcp:{WIRE}:80",
            f"tcp:{WIRE}:32526",
            f"peer:{SEC}:8444",
        )
        self.serve("f", f"tcp:{FWD_IP}:2222")
        # The attested SSH ingress: a host process on every address of the VM (and port 22,
        # which nothing may reach).
        self.serve("v", "tcp:0.0.0.0:8022", "tcp:0.0.0.0:22")

    def serve(self, ns: str, *specs: str) -> None:
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.ns[ns], sys.executable, "-c", SERVER, *specs],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"

    def load_dev_ruleset(self, cloud: str, path: Path) -> None:
        """A Dev CVM's host ruleset, as its launch data renders it, loaded into the VM."""
        ruleset = LaunchData(
            role="dev-cvm",
            team="t",
            cvm_id="c",
            app_compose="{}",
            security_cvm_ips=(SEC,),
            console_ips=(CON,),
            cloud=cloud,
        ).host_firewall
        assert ruleset is not None
        path.write_text(ruleset)
        self.ruleset = path
        self.ex("v", "nft", "-f", str(path))

    def probe(self, ns: str, *specs: str, uid: int = 0) -> dict[str, bool]:
        # Another uid cannot read the test's interpreter (under /root): the system python3.
        drop = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"] if uid else []
        python = "/usr/bin/python3" if uid else sys.executable
        return dict(json.loads(self.ex(ns, *drop, python, "-c", PROBE, *specs)))

    def down(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()
        for ns in self.ns.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    lab = Lab(f"uin{os.getpid() % 100000}")
    try:
        lab.up()
        # An Azure Dev CVM's ruleset (the Ready report's rule).
        path = Path(tmp_path_factory.mktemp("uin")) / "host.nft"
        lab.load_dev_ruleset("azure", path)
        # Loading twice is the reload path the launch agent takes on every boot.
        lab.ex("v", "nft", "-f", str(path))
        yield lab
    finally:
        lab.down()


def test_only_the_forwarder_reaches_the_security_cvm_tunnel(lab: Lab) -> None:
    assert lab.probe(
        "f", f"tcp:{SEC}:8443", f"tcp:{SEC}:9000", f"tcp:{OTHER}:8443", f"tcp:{WEB}:443"
    ) == {
        f"tcp:{SEC}:8443": True,
        f"tcp:{SEC}:9000": False,
        f"tcp:{OTHER}:8443": False,
        f"tcp:{WEB}:443": False,
    }
    # The sandbox and the VM's own processes reach nothing, not even the tunnel.
    for ns in ("s", "v"):
        assert lab.probe(ns, f"tcp:{SEC}:8443", f"tcp:{WEB}:443", f"tcp:{META}:80") == {
            f"tcp:{SEC}:8443": False,
            f"tcp:{WEB}:443": False,
            f"tcp:{META}:80": False,
        }


def test_only_the_forwarder_reaches_the_console_and_only_its_https_port(lab: Lab) -> None:
    # The forwarder's enrollment at first start: Console:443, nothing else there.
    assert lab.probe("f", f"tcp:{CON}:443", f"tcp:{CON}:8443", f"tcp:{OTHER}:443") == {
        f"tcp:{CON}:443": True,
        f"tcp:{CON}:8443": False,
        f"tcp:{OTHER}:443": False,
    }
    # The sandbox's forward path and the VM's own processes stay closed.
    for ns in ("s", "v"):
        assert lab.probe(ns, f"tcp:{CON}:443", f"tcp:{CON}:8443") == {
            f"tcp:{CON}:443": False,
            f"tcp:{CON}:8443": False,
        }


def test_only_root_on_the_host_reaches_the_wire_server_and_only_for_the_ready_report(
    lab: Lab,
) -> None:
    """Fails before the fix: the output chain dropped the launch agent's Ready report, so an Azure
    VM with the VM agent off never left provisioning."""
    assert lab.probe("v", f"tcp:{WIRE}:80", f"tcp:{WIRE}:32526", f"tcp:{META}:80") == {
        f"tcp:{WIRE}:80": True,
        f"tcp:{WIRE}:32526": False,  # the wire server's other port (the VM agent's): closed
        f"tcp:{META}:80": False,
    }
    # Not another host process, not a container.
    assert lab.probe("v", f"tcp:{WIRE}:80", uid=65534) == {f"tcp:{WIRE}:80": False}
    for ns in ("f", "s"):
        assert lab.probe(ns, f"tcp:{WIRE}:80") == {f"tcp:{WIRE}:80": False}


def test_the_ready_report_rule_names_only_the_clouds_own_endpoint() -> None:
    def rules(cloud: str | None) -> list[str]:
        text = render_host_ruleset(HostFirewall(security_cvm_ips=[SEC], cloud=cloud))
        return [ln.strip() for ln in text.splitlines() if "skuid 0" in ln]

    assert rules(None) == []
    assert rules("gcp") == [f"ip daddr {META} tcp dport 80 meta skuid 0 ct state new accept"]
    assert rules("azure") == [f"ip daddr {WIRE} tcp dport 80 meta skuid 0 ct state new accept"]
    with pytest.raises(ValueError, match="ready-report"):
        HostFirewall(security_cvm_ips=[SEC], cloud="aws")


def test_without_console_addresses_there_is_no_console_path() -> None:
    ruleset = render_host_ruleset(HostFirewall(security_cvm_ips=[SEC]))
    assert "dport 443" not in ruleset
    with_console = render_host_ruleset(HostFirewall(security_cvm_ips=[SEC], console_ips=[CON]))
    assert f"ip saddr {DEV_UPLINK_CIDR} ip daddr {{ {CON} }} tcp dport 443" in with_console


def test_dns_to_the_metadata_server_is_dropped_from_everywhere(lab: Lab) -> None:
    before = _dns_drops(lab)
    for ns in ("f", "s", "v"):
        assert lab.probe(ns, f"udp:{META}:53", f"tcp:{META}:53", f"udp:{SEC}:53") == {
            f"udp:{META}:53": False,
            f"tcp:{META}:53": False,
            f"udp:{SEC}:53": False,
        }
    assert _dns_drops(lab) > before


def test_the_attested_ssh_ingress_is_reached_on_the_host_from_outside_only(lab: Lab) -> None:
    assert lab.probe("n", f"tcp:{VM_IP}:8022", f"tcp:{VM_IP}:22") == {
        f"tcp:{VM_IP}:8022": True,
        f"tcp:{VM_IP}:22": False,
    }
    # Neither the sandbox's link nor the forwarder's uplink reaches it (or any host service),
    # not even at the host end of their own link.
    for ns, gateway in (("s", SBX_GW), ("f", UPLINK_HOST)):
        assert lab.probe(ns, f"tcp:{VM_IP}:8022", f"tcp:{gateway}:8022") == {
            f"tcp:{VM_IP}:8022": False,
            f"tcp:{gateway}:8022": False,
        }


def test_nothing_is_forwarded_into_the_containers(lab: Lab) -> None:
    # No compose service publishes a port: the forwarder's old SSH relay port is closed too.
    assert lab.probe("n", f"tcp:{FWD_IP}:2222") == {f"tcp:{FWD_IP}:2222": False}
    lab.serve("s", f"tcp:{SBX_IP}:2222")
    assert lab.probe("n", f"tcp:{SBX_IP}:2222") == {f"tcp:{SBX_IP}:2222": False}


def test_the_forwarders_uplink_is_masqueraded_to_the_vms_address(lab: Lab) -> None:
    """The cloud network has no route to the uplink's private /30: what the Security CVM sees is
    the VM's own address (the ruleset's postrouting masquerade)."""
    # A tunnel-port peer reporting the source address it sees; an allowed flow only.
    ruleset = render_host_ruleset(HostFirewall(security_cvm_ips=[SEC], tunnel_port=8444))
    assert f"ip saddr {DEV_UPLINK_CIDR} ip daddr != {DEV_UPLINK_CIDR} masquerade" in ruleset
    probe = (
        f"import socket; s = socket.create_connection(({SEC!r}, 8444), timeout=2); "
        "print(s.recv(64).decode())"
    )
    path = Path(f"/tmp/umbra-uin-{os.getpid()}.nft")
    try:
        path.write_text(ruleset)
        lab.ex("v", "nft", "-f", str(path))
        assert lab.ex("f", sys.executable, "-c", probe).strip() == VM_IP
    finally:
        path.unlink(missing_ok=True)
        # Back to the module's ruleset for the other tests.
        lab.ex("v", "nft", "-f", str(lab.ruleset))


def _dns_drops(lab: Lab) -> int:
    doc = json.loads(lab.ex("v", "nft", "-j", "list", "chain", "inet", TABLE, "dns_out"))
    total = 0
    for item in doc["nftables"]:
        for expr in item.get("rule", {}).get("expr", []):
            if "counter" in expr:
                total += int(expr["counter"]["packets"])
    return total


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="no Security CVM"):
        HostFirewall(security_cvm_ips=[])
    with pytest.raises(ValueError, match="IPv4"):
        HostFirewall(security_cvm_ips=["security-cvm.umbra.internal"])
    with pytest.raises(ValueError, match="IPv4"):
        HostFirewall(security_cvm_ips=[SEC], console_ips=["console.example"])
