"""The proxy's background loops, wired from its options: the policy puller, the secret puller and
the traffic-log shipper (each talks to the Console with the one client `startup.console_client`
made)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import httpx

from umbra.policy.bundle import load_public_key
from umbra.proxy.config import ProxyConfig
from umbra.proxy.identity import StaticIdentities
from umbra.proxy.spool import Shipper
from umbra.proxy.state import PolicyState
from umbra.proxy.tunnel_quote import Evidence

if TYPE_CHECKING:
    from umbra.proxy.puller import PolicyPuller


def policy_puller(
    config: ProxyConfig,
    state: PolicyState,
    identities: StaticIdentities,
    client: httpx.AsyncClient | None,
) -> PolicyPuller | None:
    """The Console's policy puller, its cached bundle already installed; None without a Console."""
    if config.console_url is None:
        return None
    from umbra.proxy.puller import PolicyPuller

    keys = [load_public_key(path) for path in config.bundle_keys]
    puller = PolicyPuller(
        config.console_url,
        config.security_cvm_id or "",
        keys,
        state,
        identities,
        config.worker_state_dir,
        interval=config.poll_interval,
        client=client,
    )
    puller.load_cache()
    return puller


def start_loops(
    config: ProxyConfig,
    state: PolicyState,
    puller: PolicyPuller | None,
    evidence: Evidence | None,
    client: httpx.AsyncClient | None,
) -> list[asyncio.Task[None]]:
    """Starts the policy puller, the secret puller and the shipper, as configured."""
    tasks: list[asyncio.Task[None]] = []
    if puller is not None:
        tasks.append(asyncio.create_task(puller.run()))
    if config.secrets_from_console:
        from umbra.proxy.secret_puller import SecretPuller

        assert evidence is not None and client is not None  # config validation
        quote_source, event_log = evidence
        secret_puller = SecretPuller(
            config.console_url or "",
            config.security_cvm_id or "",
            quote_source,
            event_log,
            state,
            client,
            interval=config.secrets_interval,
        )
        tasks.append(asyncio.create_task(secret_puller.run()))
    if config.console_url is not None:
        shipper = Shipper(
            config.spool_dir,
            config.console_url,
            interval=config.ship_interval,
            client=client,
        )
        tasks.append(asyncio.create_task(shipper.run()))
    return tasks
