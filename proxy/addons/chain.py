# mypy: disable-error-code="no-untyped-call"
"""The one mitmproxy addon Umbra registers: it runs the per-concern addons (`build_addons`, the
registry) in their order, for every mitmproxy hook any of them handles.

Why: mitmproxy dispatches every event to every registered addon in turn (a generator, a
`contextlib` guard and a coroutine per addon per event, including the `update` event it sends
after each flow hook). With eleven Umbra addons that walk was the largest single cost of a
keep-alive request in the proxy's profile (`benchmarks/proxy_cpu_bench.py --profile`). The chain
keeps one addon per concern and the order of checks, and resolves once, at start-up, which
concerns handle which hook.

Semantics are mitmproxy's: handlers run in registry order; one that raises is logged and the next
still runs (Umbra's hooks never raise: `guard` turns a fault into a denial); `AddonHalt` stops the
event for the rest; a hook whose handlers are all synchronous is dispatched synchronously (mitmproxy
calls some hooks, e.g. `configure`, from synchronous code).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any

# Importing these defines their hooks (mitmproxy registers each Hook subclass as it is defined).
from mitmproxy import addonmanager, dns, exceptions, hooks, http, tcp, tls, udp, websocket  # noqa: F401
from mitmproxy.proxy import layer, server_hooks  # noqa: F401
from mitmproxy.proxy.layers import modes  # noqa: F401

logger = logging.getLogger(__name__)

Handler = Callable[..., Any]


def hook_names() -> frozenset[str]:
    """Every event mitmproxy can send an addon."""
    return frozenset(hooks.all_hooks)


def handlers(addons: Sequence[object], name: str) -> list[Handler]:
    """The addons' handlers of hook `name`, in order (as mitmproxy finds them: a callable
    attribute of that name)."""
    found = []
    for addon in addons:
        handler = getattr(addon, name, None)
        if callable(handler):
            found.append(handler)
    return found


def _log(handler: Handler) -> None:
    # What mitmproxy's `safecall` does for a handler that raised: log, and go on with the next.
    logger.error("Addon error in %s", getattr(handler, "__qualname__", handler), exc_info=True)


def _sync_dispatch(chain: tuple[Handler, ...]) -> Handler:
    def dispatch(*args: Any) -> None:
        for handler in chain:
            try:
                handler(*args)
            except (exceptions.AddonHalt, exceptions.OptionsError):
                raise
            except Exception:
                _log(handler)

    return dispatch


def _async_dispatch(chain: tuple[Handler, ...]) -> Handler:
    async def dispatch(*args: Any) -> None:
        for handler in chain:
            try:
                result = handler(*args)
                if result is not None and inspect.isawaitable(result):
                    await result
            except (exceptions.AddonHalt, exceptions.OptionsError):
                raise
            except Exception:
                _log(handler)

    return dispatch


class Chain:
    """One addon for mitmproxy, the registry's addons in order behind it. Only the hooks some
    concern handles are attributes (mitmproxy skips the rest without a call)."""

    name = "umbra"

    def __init__(self, addons: Sequence[object]) -> None:
        # Not `addons`: mitmproxy would walk that attribute and call every concern a second time.
        self.concerns = tuple(addons)
        self.hooks: dict[str, tuple[Handler, ...]] = {}
        for name in sorted(hook_names()):
            chain = tuple(handlers(self.concerns, name))
            if not chain:
                continue
            self.hooks[name] = chain
            is_async = any(inspect.iscoroutinefunction(handler) for handler in chain)
            dispatch = _async_dispatch(chain) if is_async else _sync_dispatch(chain)
            if len(chain) == 1:
                dispatch = chain[0]  # nothing to order: mitmproxy calls the handler itself
            setattr(self, name, dispatch)
