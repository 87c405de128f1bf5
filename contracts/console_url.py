"""Which Console URLs a client may send a bearer token to: one rule for every client."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit


class ConsoleUrlError(ValueError):
    """A Console URL we refuse to send a bearer token to."""


_LOOPBACK_NAMES = {"localhost", "localhost.", "ip6-localhost"}


def check_console_url(url: str) -> str:
    """https://, or http:// to a loopback address only: tokens never cross a network in clear."""
    parts = urlsplit(url)
    if parts.scheme == "https" and parts.hostname:
        return url
    if parts.scheme == "http" and parts.hostname:
        host = parts.hostname.lower()
        try:
            loopback = host in _LOOPBACK_NAMES or ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if loopback:
            return url
        raise ConsoleUrlError(
            f"refusing http:// to {host}: use https:// (http is for loopback only)"
        )
    raise ConsoleUrlError(f"{url[:80]!r} is not an https:// URL")
