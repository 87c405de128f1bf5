"""Where exported events go: an OTLP/HTTP logs endpoint or a syslog receiver over TLS.

`send` returns when the receiver has taken the batch (OTLP: a 2xx answer; syslog: the TLS stream
accepted every byte, which is all RFC 5425 offers: no application acknowledgement) and raises
`SinkError` otherwise, so the cursor only moves past what was sent."""

from __future__ import annotations

import json
import logging
import socket
import ssl
import time
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

import httpx

from umbra.console.export import mapping

log = logging.getLogger(__name__)
TIMEOUT_SECONDS = 10.0


class SinkName(StrEnum):
    OTLP = "otlp"
    SYSLOG = "syslog"


class SinkError(Exception):
    """The receiver did not take the batch (the message says why, without the batch)."""


class Sink(Protocol):
    name: SinkName

    def send(self, events: list[dict[str, Any]]) -> None: ...

    def close(self) -> None: ...


def _tls_context(ca_file: Path | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


class OtlpSink:
    name = SinkName.OTLP

    def __init__(self, url: str, ca_file: Path | None) -> None:
        self._url = url
        self._client = httpx.Client(
            verify=_tls_context(ca_file), timeout=TIMEOUT_SECONDS, follow_redirects=False
        )

    def send(self, events: list[dict[str, Any]]) -> None:
        body = json.dumps(mapping.otlp_request(events, time.time_ns()), separators=(",", ":"))
        try:
            response = self._client.post(
                self._url, content=body, headers={"Content-Type": "application/json"}
            )
        except httpx.HTTPError as exc:
            raise SinkError(f"otlp: {type(exc).__name__}") from None
        if not 200 <= response.status_code < 300:
            raise SinkError(f"otlp: receiver answered {response.status_code}")
        rejected = _rejected(response)
        if rejected:
            # The receiver took the request and refused some records for good: re-sending the
            # same records would be refused again, so this is logged, not retried.
            log.warning("otlp: receiver rejected %d of %d log records", rejected, len(events))

    def close(self) -> None:
        self._client.close()


def _rejected(response: httpx.Response) -> int:
    try:
        partial = response.json().get("partialSuccess") or {}
        return int(partial.get("rejectedLogRecords") or 0)
    except (ValueError, AttributeError, TypeError):
        return 0


class SyslogSink:
    name = SinkName.SYSLOG

    def __init__(self, url: str, ca_file: Path | None) -> None:
        host, _, port = url.removeprefix("tls://").rpartition(":")
        self._address = (host.strip("[]"), int(port))
        self._context = _tls_context(ca_file)
        self._socket: ssl.SSLSocket | None = None

    def _connect(self) -> ssl.SSLSocket:
        if self._socket is None:
            raw = socket.create_connection(self._address, timeout=TIMEOUT_SECONDS)
            try:
                self._socket = self._context.wrap_socket(raw, server_hostname=self._address[0])
            except BaseException:
                raw.close()
                raise
        return self._socket

    def send(self, events: list[dict[str, Any]]) -> None:
        frames = b"".join(mapping.octet_counted(mapping.syslog_message(e)) for e in events)
        try:
            self._connect().sendall(frames)
        except (OSError, ssl.SSLError) as exc:
            self.close()  # the next attempt reconnects and sends the whole batch again
            raise SinkError(f"syslog: {type(exc).__name__}") from None

    def close(self) -> None:
        if self._socket is not None:
            try:
                self._socket.close()
            finally:
                self._socket = None


def from_settings(otlp_url: str | None, syslog_url: str | None, ca_file: Path | None) -> list[Sink]:
    sinks: list[Sink] = []
    if otlp_url:
        sinks.append(OtlpSink(otlp_url, ca_file))
    if syslog_url:
        sinks.append(SyslogSink(syslog_url, ca_file))
    return sinks


def configured(otlp_url: str | None, syslog_url: str | None) -> list[SinkName]:
    """The sinks the settings name (what traffic retention waits for), without connecting."""
    return [name for name, url in ((SinkName.OTLP, otlp_url), (SinkName.SYSLOG, syslog_url)) if url]
