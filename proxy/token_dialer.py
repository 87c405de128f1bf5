"""POSTs to a token endpoint the way the proxy dials any upstream: resolved by the proxy's
resolver, every address checked by its address policy, the checked address dialled with the name
as SNI and Host, TLS verified, no redirects, answers over 64 KiB ignored (`proxy/minting.py`)."""

from __future__ import annotations

import json
import ssl
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from umbra.proxy.mint_errors import CredentialRefused, CredentialUnavailable
from umbra.proxy.netcheck import AddressPolicy, AddressVerdict, parse_ip
from umbra.proxy.resolver import ResolutionError, Resolver

MAX_TOKEN_RESPONSE = 64 << 10


class TokenDialer:
    """POSTs a form (or nothing) to a token endpoint, dialling only addresses the proxy may dial."""

    def __init__(
        self,
        resolver: Resolver,
        addresses: Callable[[], AddressPolicy],
        verify: ssl.SSLContext | bool = True,
        timeout: float = 8.0,  # under the Minter's wait: a request sees the call's own outcome
    ) -> None:
        self.resolver = resolver
        self.addresses = addresses
        self.timeout = timeout
        self._client = httpx.AsyncClient(verify=verify, timeout=timeout, follow_redirects=False)

    async def post(
        self, url: str, form: dict[str, str] | None, headers: dict[str, str]
    ) -> tuple[int, dict[str, Any] | None]:
        """POST `form` (None: an empty body, as GitHub's token exchange takes); `headers` may
        replace the default `Accept`."""
        parts = urlsplit(url)
        host, port = (parts.hostname or "").lower(), parts.port or 443
        address = parse_ip(host)
        try:
            addresses = [address] if address is not None else await self.resolver.resolve(host)
        except ResolutionError:
            raise CredentialUnavailable(f"token endpoint {host} does not resolve") from None
        policy = self.addresses()
        for candidate in addresses:
            verdict = policy.check(candidate, port)
            if verdict is not AddressVerdict.OK:
                # Not a refusal by the endpoint: a misconfigured (or hostile) token_url.
                raise CredentialRefused(f"token endpoint {host} is a refused address ({verdict})")
        pinned = str(addresses[0])
        netloc = f"[{pinned}]:{port}" if ":" in pinned else f"{pinned}:{port}"
        target = urlunsplit(("https", netloc, parts.path or "/", parts.query, ""))
        try:
            response = await self._client.post(
                target,
                data=form,
                headers={
                    "Accept": "application/json",
                    **headers,
                    "Host": parts.netloc.rpartition("@")[2],
                },
                extensions={"sni_hostname": host},
            )
        except httpx.HTTPError as exc:
            raise CredentialUnavailable(
                f"token endpoint {host} unreachable ({type(exc).__name__})"
            ) from None
        body: dict[str, Any] | None = None
        if len(response.content) <= MAX_TOKEN_RESPONSE:
            try:
                parsed = json.loads(response.content)
                body = parsed if isinstance(parsed, dict) else None
            except ValueError:
                body = None
        return response.status_code, body

    async def aclose(self) -> None:
        await self._client.aclose()
