"""The chain mitmproxy sees runs every registered addon's every hook, in the registry's order, with
mitmproxy's semantics (a raising handler is logged and the next runs; sync stays sync)."""

from __future__ import annotations

import asyncio
import inspect
import logging
from pathlib import Path
from typing import Any

import pytest

from umbra.proxy.addons import AddonConfig, Shared, build_addons
from umbra.proxy.addons.chain import Chain, handlers, hook_names
from umbra.proxy.identity import StaticIdentities
from umbra.proxy.netcheck import AddressPolicy
from umbra.proxy.resolver import StaticResolver
from umbra.proxy.secrets import SecretStore
from umbra.proxy.state import PolicyState


def _registry(tmp_path: Path) -> list[object]:
    resolver = tmp_path / "resolver.json"
    resolver.write_text("{}")
    shared = Shared(
        AddonConfig(
            state=PolicyState(SecretStore({}, {})),
            identities=StaticIdentities([]),
            resolver=StaticResolver.from_file(resolver),
            addresses=AddressPolicy(),
            spool=None,
            max_body=1 << 20,
        )
    )
    return build_addons(shared)


def test_the_chain_covers_every_hook_of_every_registered_addon(tmp_path: Path) -> None:
    registry = _registry(tmp_path)
    chain = Chain(registry)
    assert chain.concerns == tuple(registry)
    covered: set[str] = set()
    for name in hook_names():
        expected = handlers(registry, name)
        if not expected:
            assert getattr(chain, name, None) is None, f"{name}: no concern handles it"
            continue
        covered.add(name)
        assert chain.hooks[name] == tuple(expected), f"{name}: every handler, registry order"
        assert callable(getattr(chain, name))
    # Every addon in the registry is reached through at least one hook.
    reached = {
        id(getattr(handler, "__self__", None))
        for handlers_ in chain.hooks.values()
        for handler in handlers_
    }
    assert reached == {id(addon) for addon in registry}
    # The hooks Umbra is known to act on are among them (a renamed hook would silently vanish).
    assert {"client_connected", "http_connect", "requestheaders", "request", "responseheaders",
            "response", "server_connect", "next_layer", "tls_clienthello", "websocket_message",
            "error"} <= covered  # fmt: skip
    # mitmproxy must not walk the concerns itself too (it would call each hook twice).
    assert not hasattr(chain, "addons")


class _Recorder:
    def __init__(self, name: str, calls: list[str], *, fail: bool = False) -> None:
        self.name, self.calls, self.fail = name, calls, fail

    def request(self, flow: Any) -> None:
        self.calls.append(f"{self.name}.request")
        if self.fail:
            raise RuntimeError("boom")

    def configure(self, updated: Any) -> None:
        self.calls.append(f"{self.name}.configure")


class _AsyncRecorder(_Recorder):
    async def request(self, flow: Any) -> None:  # type: ignore[override]
        await asyncio.sleep(0)
        self.calls.append(f"{self.name}.request")


def test_order_faults_and_sync_dispatch(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[str] = []
    chain = Chain(
        [_Recorder("a", calls, fail=True), _AsyncRecorder("b", calls), _Recorder("c", calls)]
    )
    with caplog.at_level(logging.ERROR):
        asyncio.run(chain.request(object()))  # type: ignore[attr-defined]
    assert calls == ["a.request", "b.request", "c.request"], "a fault does not skip the rest"
    assert "Addon error" in caplog.text
    calls.clear()
    configure = chain.configure  # type: ignore[attr-defined]
    assert not inspect.iscoroutinefunction(configure), "mitmproxy calls configure synchronously"
    configure(set())
    assert calls == ["a.configure", "b.configure", "c.configure"]
    assert getattr(chain, "response", None) is None
