"""`--test-hosts` (embedded mode): the static map's names from the map, every other name from the
system resolver; never both flags."""

from __future__ import annotations

import asyncio
import ipaddress
import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from umbra.proxy.config import ProxyConfig
from umbra.proxy.netcheck import IPAddress
from umbra.proxy.resolver import OverlayResolver, ResolutionError, StaticResolver


class Recording:
    def __init__(self) -> None:
        self.asked: list[str] = []

    async def resolve(self, host: str) -> list[IPAddress]:
        self.asked.append(host)
        if host == "nowhere.test":
            raise ResolutionError(f"{host} does not resolve")
        return [ipaddress.ip_address("203.0.113.80")]


def test_static_names_first_everything_else_from_the_system() -> None:
    system = Recording()
    overlay = OverlayResolver(StaticResolver({"api.demo.test": ["127.0.0.1"]}), system)

    async def go() -> tuple[list[IPAddress], list[IPAddress]]:
        return await overlay.resolve("api.demo.test"), await overlay.resolve("pypi.org")

    demo, real = asyncio.run(go())
    assert demo == [ipaddress.ip_address("127.0.0.1")]
    assert real == [ipaddress.ip_address("203.0.113.80")]
    assert system.asked == ["pypi.org"]  # the static name never reaches DNS
    with pytest.raises(ResolutionError):
        asyncio.run(overlay.resolve("nowhere.test"))


def test_test_hosts_and_test_resolver_exclude_each_other(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps({"api.demo.test": ["127.0.0.1"]}))
    base = {
        "listen_host": "127.0.0.1",
        "listen_port": 0,
        "policy_dir": tmp_path,
        "identities": tmp_path / "identities.json",
        "traffic_log": tmp_path / "spool",
        "confdir": tmp_path / "ca",
    }
    assert ProxyConfig(**base, test_hosts=hosts).test_hosts == hosts
    with pytest.raises(ValidationError, match="at most one of --test-resolver and --test-hosts"):
        ProxyConfig(**base, test_hosts=hosts, test_resolver=hosts)
