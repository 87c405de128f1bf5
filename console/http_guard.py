"""uvicorn's HTTP/1.1 protocol with two guards it lacks: a deadline for reading a request's
header section (a slow-loris client trickling header bytes otherwise holds a connection open
forever: uvicorn's keep-alive timer stops at the first byte), and 431 rather than 400 for a
header section over the size limit."""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_READ_TIMEOUT = 10.0


class GuardedH11Protocol(H11Protocol):
    header_read_timeout = HEADER_READ_TIMEOUT

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_deadline: asyncio.TimerHandle | None = None
        self._head = bytearray()  # the header section read so far (bounded by the limit)
        self._head_limit: int = self.config.h11_max_incomplete_event_size or (16 << 10)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._header_deadline = self.loop.call_later(self.header_read_timeout, self._expired)

    def _disarm(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _expired(self) -> None:
        self._header_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.logger.info("closing a connection whose request headers did not arrive in time")
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        # h11 bounds only an *incomplete* header section; one that arrives whole is parsed at
        # any size. Count the header bytes of each request here instead.
        if self.conn.their_state is h11.IDLE:
            self._head += data
            end = self._head.find(b"\r\n\r\n")
            if (end if end >= 0 else len(self._head)) > self._head_limit:
                self._too_large()
                return
            if end >= 0:
                self._head.clear()
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm()  # the header section is complete

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request on this connection gets its own deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _too_large(self) -> None:
        self._disarm()
        self._head.clear()
        body = b"request header fields are too large"
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        self.transport.close()
