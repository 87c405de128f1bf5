"""Name resolution done by the proxy itself, so that the addresses it checks are the ones it dials.

`SystemResolver` asks the operating system; `StaticResolver` answers from a fixed map and exists so
tests control every answer (including answers that change between lookups, to exercise rebinding);
`OverlayResolver` answers the names of a static map from it and every other name from the system
(embedded mode: real names resolve for real, a local stand-in origin is the one exception).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from umbra.proxy.netcheck import IPAddress

MAX_ANSWERS = 32


class ResolutionError(Exception):
    """A name that did not resolve to any address."""


class Resolver(Protocol):
    async def resolve(self, host: str) -> list[IPAddress]:
        """Every address `host` (a normalized name, never an IP literal) resolves to."""
        ...


class SystemResolver:
    async def resolve(self, host: str) -> list[IPAddress]:
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(
                loop.getaddrinfo(host, None, type=socket.SOCK_STREAM), timeout=10
            )
        except (OSError, TimeoutError) as exc:
            raise ResolutionError(f"{host} does not resolve ({type(exc).__name__})") from None
        addresses: list[IPAddress] = []
        for _family, _type, _proto, _canon, sockaddr in infos[:MAX_ANSWERS]:
            address = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
            if address not in addresses:
                addresses.append(address)
        if not addresses:
            raise ResolutionError(f"{host} resolves to no address")
        return addresses


class StaticResolver:
    """Answers from a map `name -> [address, ...]` or `name -> [[answer 1], [answer 2], ...]`.

    With a list of answers, successive lookups return successive answers and the last one repeats,
    which is how a rebinding DNS server behaves. A name mapped to the string "fail" raises inside
    the resolver (not a ResolutionError) so tests can prove an unexpected exception denies.
    """

    def __init__(self, answers: dict[str, list[str] | list[list[str]] | str]) -> None:
        self._answers: dict[str, list[list[IPAddress]] | str] = {}
        for name, value in answers.items():
            if isinstance(value, str):
                self._answers[name.lower()] = value
                continue
            rounds: Sequence[list[str]] = (
                [value]  # type: ignore[list-item]
                if all(isinstance(item, str) for item in value)
                else value  # type: ignore[assignment]
            )
            self._answers[name.lower()] = [
                [ipaddress.ip_address(item) for item in answer] for answer in rounds
            ]
        self._lookups: dict[str, int] = {}

    @classmethod
    def from_file(cls, path: Path) -> StaticResolver:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object of name -> addresses")
        return cls(data)

    def knows(self, host: str) -> bool:
        return host in self._answers

    async def resolve(self, host: str) -> list[IPAddress]:
        entry = self._answers.get(host)
        if entry is None:
            raise ResolutionError(f"{host} is not in the static resolver map")
        if isinstance(entry, str):
            raise RuntimeError(f"static resolver entry for {host} is set to fail")
        count = self._lookups.get(host, 0)
        self._lookups[host] = count + 1
        return list(entry[min(count, len(entry) - 1)])


class OverlayResolver:
    """The static map's names from the map, every other name from `fallback`. Every address is
    still checked by the dial guard, whichever answered."""

    def __init__(self, static: StaticResolver, fallback: Resolver) -> None:
        self.static = static
        self.fallback = fallback

    async def resolve(self, host: str) -> list[IPAddress]:
        if self.static.knows(host):
            return await self.static.resolve(host)
        return await self.fallback.resolve(host)
