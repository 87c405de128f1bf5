"""The one place Umbra reaches into mitmproxy internals, checked at start-up.

mitmproxy applies `body_size_limit` to requests and responses alike, before any hook runs. Umbra
needs the limit on requests (a body over it gets 413 and is never forwarded unscanned) but not on
responses it does not need to inspect (downloads of any size). `install()` wraps
`HttpStream.check_body_size` so that, for a response whose flow the addon marked
`umbra.stream_response`, the limit is skipped; requests keep mitmproxy's own check unchanged.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from mitmproxy.proxy.layers import http as http_layers
from mitmproxy.version import VERSION

STREAM_RESPONSE = "umbra.stream_response"
_installed = False


class CompatError(RuntimeError):
    pass


def install() -> None:
    global _installed
    if _installed:
        return
    if not VERSION.startswith("12."):
        raise CompatError(f"Umbra's proxy is built for mitmproxy 12, found {VERSION}")
    stream_cls: Any = getattr(http_layers, "HttpStream", None)
    original = getattr(stream_cls, "check_body_size", None)
    if original is None:
        raise CompatError("mitmproxy's HttpStream.check_body_size is missing; refusing to run")

    def check_body_size(self: Any, request: bool) -> Generator[Any, Any, bool]:
        if not request and self.flow.metadata.get(STREAM_RESPONSE):
            if self.flow.response is not None:
                self.flow.response.stream = True
            return False
        result: bool = yield from original(self, request)
        return result

    stream_cls.check_body_size = check_body_size
    _installed = True
