"""Which upstream addresses the proxy may dial.

Only globally routable unicast addresses pass. IPv6 forms that carry an IPv4 address (IPv4-mapped,
IPv4-compatible, NAT64, 6to4, Teredo) are judged by the address they carry as well as by themselves,
and the proxy's own addresses never pass. A test-only allowance can admit named networks (loopback
origin servers in tests); it never admits the proxy's own listening socket.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

type IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
type IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class AddressVerdict(StrEnum):
    OK = "ok"
    LOOPBACK = "loopback"
    PRIVATE = "private"
    LINK_LOCAL = "link_local"
    METADATA = "metadata"
    CGNAT = "cgnat"
    ULA = "ula"
    MULTICAST = "multicast"
    UNSPECIFIED = "unspecified"
    RESERVED = "reserved"
    NOT_GLOBAL = "not_global"
    TRANSITION = "ipv6_transition"
    PROXY_SELF = "proxy_self"


_METADATA = {ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254")}
_CGNAT = ipaddress.ip_network("100.64.0.0/10")
_ULA = ipaddress.ip_network("fc00::/7")
_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
_SIX_TO_FOUR = ipaddress.ip_network("2002::/16")
_TEREDO = ipaddress.ip_network("2001::/32")
_IPV4_COMPAT = ipaddress.ip_network("::/96")


def embedded_ipv4(address: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """Every IPv4 address an IPv6 address may be carrying, by any transition mechanism."""
    found: list[ipaddress.IPv4Address] = []
    if address.ipv4_mapped is not None:
        found.append(address.ipv4_mapped)
    value = int(address)
    if address in _IPV4_COMPAT and value > 1:
        found.append(ipaddress.IPv4Address(value & 0xFFFFFFFF))
    if any(address in net for net in _NAT64):
        found.append(ipaddress.IPv4Address(value & 0xFFFFFFFF))
    if address.sixtofour is not None:
        found.append(address.sixtofour)
    if address.teredo is not None:
        server, client = address.teredo
        found.extend([server, client])
    return found


def classify(address: IPAddress) -> AddressVerdict:
    """The verdict for one address on its own (the proxy's own addresses are checked separately)."""
    if address in _METADATA:
        return AddressVerdict.METADATA
    if address.is_unspecified:
        return AddressVerdict.UNSPECIFIED
    if address.is_loopback:
        return AddressVerdict.LOOPBACK
    if address.is_link_local:
        return AddressVerdict.LINK_LOCAL
    if address.is_multicast:
        return AddressVerdict.MULTICAST
    if isinstance(address, ipaddress.IPv4Address) and address in _CGNAT:
        return AddressVerdict.CGNAT
    if isinstance(address, ipaddress.IPv6Address):
        if address in _ULA:
            return AddressVerdict.ULA
        if address in _SIX_TO_FOUR or address in _TEREDO:
            # Deprecated tunnels that relay to an arbitrary IPv4 host: never dialled.
            return AddressVerdict.TRANSITION
        for inner in embedded_ipv4(address):
            verdict = classify(inner)
            if verdict is not AddressVerdict.OK:
                return verdict
        if address.ipv4_mapped is not None or address in _IPV4_COMPAT:
            return AddressVerdict.TRANSITION
    if address.is_private:
        return AddressVerdict.PRIVATE
    if address.is_reserved:
        return AddressVerdict.RESERVED
    if not address.is_global:
        return AddressVerdict.NOT_GLOBAL
    return AddressVerdict.OK


@dataclass(frozen=True)
class AddressPolicy:
    """Decides whether the proxy may dial `(address, port)`."""

    own_addresses: frozenset[IPAddress] = frozenset()
    own_sockets: frozenset[tuple[IPAddress, int]] = frozenset()
    test_allow: tuple[IPNetwork, ...] = field(default=())

    def check(self, address: IPAddress, port: int) -> AddressVerdict:
        if (address, port) in self.own_sockets:
            return AddressVerdict.PROXY_SELF
        if any(address in net for net in self.test_allow):
            return AddressVerdict.OK
        verdict = classify(address)
        if verdict is AddressVerdict.OK and address in self.own_addresses:
            return AddressVerdict.PROXY_SELF
        return verdict

    def with_own(
        self, addresses: Iterable[IPAddress], sockets: Iterable[tuple[IPAddress, int]]
    ) -> AddressPolicy:
        return AddressPolicy(
            own_addresses=self.own_addresses | frozenset(addresses),
            own_sockets=self.own_sockets | frozenset(sockets),
            test_allow=self.test_allow,
        )


def parse_ip(text: str) -> IPAddress | None:
    """A strict IP literal (no zone ids, no brackets), or None."""
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None
