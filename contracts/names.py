"""Names that cross a wire: CVM ids and destination hosts, checked the same way on both ends."""

from __future__ import annotations

import ipaddress
import re

CVM_ID_PATTERN = r"^[A-Za-z0-9._-]{1,128}$"
_HOST_RE = re.compile(
    r"^(?=.{1,253}$)[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?)*$"
)


def check_host(host: str) -> str:
    """A DNS name (lowercase, no trailing dot) or an IP literal; nothing that needs escaping."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    if not _HOST_RE.match(host):
        raise ValueError(f"{host!r} is not a lowercase DNS name or an IP address")
    return host
