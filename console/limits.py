"""Request size limits, enforced while the body streams in (not only from Content-Length)."""

from __future__ import annotations

import re
from collections.abc import Callable

from fastapi import HTTPException, status
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_BUNDLE_UPLOAD = re.compile(r"^/api/v1/teams/[^/]+/bundles/?$")
_TRAFFIC = re.compile(r"^/api/v1/traffic/batches/?$")


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(
            status.HTTP_413_CONTENT_TOO_LARGE, f"request body is larger than {limit} bytes"
        )


def limit_for(settings_default: int, bundle: int, traffic: int) -> Callable[[str], int]:
    def choose(path: str) -> int:
        if _BUNDLE_UPLOAD.match(path):
            return bundle
        if _TRAFFIC.match(path):
            return traffic
        return settings_default

    return choose


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, limit: Callable[[str], int]) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit(scope["path"])
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared < 0 or declared > limit:
                    await _reply_413(send, limit)
                    return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, limited_receive, send)


async def _reply_413(send: Send, limit: int) -> None:
    body = f'{{"detail":"request body is larger than {limit} bytes"}}'.encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
