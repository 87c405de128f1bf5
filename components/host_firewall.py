"""The Dev CVM's host nftables ruleset: the guest-side half of "a Dev CVM reaches nothing but its
Security CVM". Cloud firewalls do not govern the metadata server's DNS (GCP 169.254.169.254,
Azure 168.63.129.16), so a name lookup is a channel out unless the guest drops it itself.

The Dev CVM's sandbox and forwarder are the runc topology of sandbox/dev_host.py: the sandbox's
only link ends in the forwarder's network namespace (which forwards nothing), and the forwarder's
uplink (`uplink_cidr`, a /30) ends on the host.

The ruleset (one `inet` table, replaced atomically with `nft -f`):
- forward: only the forwarder's uplink may open connections, only to the Security CVM's tunnel
  port and (for its one enrollment at first start) the Console's HTTPS port; replies of allowed
  flows pass; everything else, DNS first, is dropped. Nothing is forwarded *into* the sandbox or
  the forwarder's namespace.
- postrouting (nat): what leaves from the uplink is masqueraded to the host's address (the cloud
  network has no route to the uplink's private /30).
- output (the host's own processes): loopback, replies, DHCP, root's HTTP to the cloud's ready
  report endpoint (the launch agent's report after the compose started: Azure's wire server,
  GCP's metadata server), and optionally NTP and an IMDS HTTP allowance for named uids (Azure's
  TD quote comes from IMDS); never DNS, never anything else.
- input: loopback, replies, DHCP replies, and the attested SSH ingress's port (`umbra sandbox
  ingress`, a host process the launch agent starts), but never from the forwarder's uplink or the
  sandbox's link: neither reaches the host's own services, nor the gateway that decides who logs
  into the sandbox.

A pure function of its inputs: the launch agent writes the text to a file and runs `nft -f`
before it starts containers (tests/infra/test_host_firewall.py loads it with real nft).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, field

from umbra.components.ports import (
    CONSOLE_PORT,
    DEV_ATTESTED_SSH_PORT,
    DEV_INTERNAL_CIDRS,
    DEV_UPLINK_CIDR,
    METADATA_ADDRESSES,
    READY_REPORT_ADDRESSES,
    READY_REPORT_PORT,
    SECURITY_TUNNEL_PORT,
)

TABLE = "umbra_host"


@dataclass(frozen=True)
class HostFirewall:
    security_cvm_ips: Sequence[str]
    tunnel_port: int = SECURITY_TUNNEL_PORT
    # The Console's address(es): the forwarder enrolls there (one-time token -> tunnel
    # credential, docs/specs/embedded.md "Enrollment"). Empty: no Console path at all.
    console_ips: Sequence[str] = ()
    console_port: int = CONSOLE_PORT
    uplink_cidr: str = DEV_UPLINK_CIDR
    internal_cidrs: Sequence[str] = DEV_INTERNAL_CIDRS
    ssh_port: int = DEV_ATTESTED_SSH_PORT
    metadata_addresses: Sequence[str] = METADATA_ADDRESSES
    # Host NTP servers (GCP: the metadata server answers NTP on 169.254.169.254). Empty: none.
    ntp_servers: Sequence[str] = ()
    # uids allowed HTTP to the metadata address (Azure: the attestation agent fetching TD quotes).
    imds_http_uids: Sequence[int] = field(default_factory=tuple)
    # The cloud whose ready-report endpoint root may reach on HTTP (READY_REPORT_ADDRESSES);
    # None: no report path (the launch agent's report is then dropped, and says so).
    cloud: str | None = None

    def __post_init__(self) -> None:
        if not self.security_cvm_ips:
            raise ValueError("HostFirewall: no Security CVM address")
        if self.cloud is not None and self.cloud not in READY_REPORT_ADDRESSES:
            raise ValueError(f"HostFirewall: no ready-report endpoint for cloud {self.cloud!r}")
        for ip in [
            *self.security_cvm_ips,
            *self.console_ips,
            *self.metadata_addresses,
            *self.ntp_servers,
        ]:
            try:
                ipaddress.IPv4Address(ip)
            except ValueError:
                # No names: resolving one is exactly the DNS this ruleset closes.
                raise ValueError(f"HostFirewall: {ip!r} is not an IPv4 address") from None
        for cidr in [self.uplink_cidr, *self.internal_cidrs]:
            ipaddress.IPv4Network(cidr)
        for port in (
            self.tunnel_port,
            self.console_port,
            self.ssh_port,
        ):
            if not 0 < port < 65536:
                raise ValueError(f"HostFirewall: port {port} out of range")
        for uid in self.imds_http_uids:
            if uid < 0:
                raise ValueError(f"HostFirewall: uid {uid} is negative")


def _set(values: Sequence[str] | Sequence[int]) -> str:
    return "{ " + ", ".join(str(v) for v in values) + " }"


def render_host_ruleset(fw: HostFirewall) -> str:
    """The nft script: deletes and recreates the table in one transaction (flush-safe reload)."""
    sec = _set(fw.security_cvm_ips)
    meta = _set(fw.metadata_addresses)
    inside = _set([fw.uplink_cidr, *fw.internal_cidrs])
    lines = [
        f"table inet {TABLE}",
        f"delete table inet {TABLE}",
        f"table inet {TABLE} {{",
        "  chain dns_out {",
        f"    ip daddr {meta} meta l4proto {{ tcp, udp }} th dport 53 counter drop",
        "    meta l4proto { tcp, udp } th dport { 53, 853 } counter drop",
        "  }",
        "  chain input {",
        "    type filter hook input priority filter; policy drop;",
        '    iif "lo" accept',
        "    ct state established,related accept",
        "    ct state invalid drop",
        "    udp sport 67 udp dport 68 accept",
        f"    ip saddr {inside} counter drop",
        f"    tcp dport {fw.ssh_port} ct state new accept",
        "    counter drop",
        "  }",
        "  chain forward {",
        "    type filter hook forward priority filter; policy drop;",
        "    ct state established,related accept",
        "    ct state invalid drop",
        "    jump dns_out",
        f"    ip saddr {fw.uplink_cidr} ip daddr {sec} tcp dport {fw.tunnel_port} ct state new accept",
    ]
    if fw.console_ips:
        # The forwarder's enrollment; the sandbox's networks never match the uplink source.
        lines.append(
            f"    ip saddr {fw.uplink_cidr} ip daddr {_set(fw.console_ips)} "
            f"tcp dport {fw.console_port} ct state new accept"
        )
    lines += [
        "    counter drop",
        "  }",
        "  chain output {",
        "    type filter hook output priority filter; policy drop;",
        '    oif "lo" accept',
        "    ct state established,related accept",
        "    jump dns_out",
        "    udp sport 68 udp dport 67 accept",
    ]
    if fw.cloud is not None:
        # Exactly the launch agent's ready report: root, TCP to the one platform address, port 80.
        lines.append(
            f"    ip daddr {READY_REPORT_ADDRESSES[fw.cloud]} tcp dport {READY_REPORT_PORT} "
            "meta skuid 0 ct state new accept"
        )
    if fw.ntp_servers:
        lines.append(f"    ip daddr {_set(fw.ntp_servers)} udp dport 123 accept")
    if fw.imds_http_uids:
        lines.append(
            f"    ip daddr {meta} tcp dport 80 meta skuid {_set(fw.imds_http_uids)} accept"
        )
    lines += [
        "    counter drop",
        "  }",
        "  chain postrouting {",
        "    type nat hook postrouting priority srcnat; policy accept;",
        f"    ip saddr {fw.uplink_cidr} ip daddr != {fw.uplink_cidr} masquerade",
        "  }",
        "}",
        "",
    ]
    return "\n".join(lines)
