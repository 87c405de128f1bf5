"""The proxy's own addresses and listening sockets, which the dial guard never dials (a sandbox
must not reach the proxy, or the host behind it, through the proxy)."""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from collections.abc import Iterable
from pathlib import Path

from umbra.proxy.netcheck import IPAddress


def interface_addresses() -> set[IPAddress]:
    """Every address of every local interface (Linux: from /proc), so none of them is dialled."""
    found: set[IPAddress] = set()
    with contextlib.suppress(OSError):
        # fib_trie lists each local IPv4 address as a `/32 host LOCAL` leaf.
        previous = ""
        for line in Path("/proc/net/fib_trie").read_text().splitlines():
            if "/32 host LOCAL" in line and previous:
                with contextlib.suppress(ValueError):
                    found.add(ipaddress.ip_address(previous.split()[-1]))
            previous = line
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/if_inet6").read_text().splitlines():
            hexaddr = line.split()[0]
            with contextlib.suppress(ValueError):
                found.add(ipaddress.ip_address(int(hexaddr, 16)))
    return found


def own_addresses(listen_host: str) -> set[IPAddress]:
    found: set[IPAddress] = interface_addresses()
    candidates = [listen_host, socket.gethostname()]
    for name in candidates:
        with contextlib.suppress(OSError, UnicodeError):
            for info in socket.getaddrinfo(name, None):
                with contextlib.suppress(ValueError):
                    found.add(ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]))
    return {address for address in found if not address.is_unspecified}


def own_sockets(
    listen_addrs: Iterable[tuple[str, int]], ports: set[int], own: set[IPAddress]
) -> list[tuple[IPAddress, int]]:
    """Every (address, port) the listeners answer on."""
    listened = {ipaddress.ip_address(a[0].split("%")[0]) for a in listen_addrs}
    if any(address.is_unspecified for address in listened):
        # Listening on every interface: every local address is this socket.
        listened |= own | {ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")}
    return [(address, each) for address in listened for each in ports]
