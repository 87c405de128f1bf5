"""What the proxy loads before it serves, failing closed with one message saying which and why.

A policy, bundle, identities, secrets, evidence or Console credential that does not load stops the
proxy (`StartupError`) rather than letting it serve with less policy than configured.
"""

from __future__ import annotations

import ipaddress
import logging
import ssl
import sys
from typing import NamedTuple

import httpx

from umbra.attest.atls import CollateralProvider
from umbra.attest.collateral import CollateralRelay, PccsCollateral
from umbra.policy import BundleError, PolicyError
from umbra.policy.bundle import load_public_key
from umbra.policy.loader import load_policy_dir
from umbra.proxy.config import ProxyConfig
from umbra.proxy.identity import StaticIdentities
from umbra.proxy.netcheck import AddressPolicy, IPNetwork
from umbra.proxy.resolver import OverlayResolver, Resolver, StaticResolver, SystemResolver
from umbra.proxy.secrets import SecretStore
from umbra.proxy.state import PolicyState
from umbra.proxy.tunnel_quote import Evidence, EvidenceError, build_evidence


class StartupError(Exception):
    pass


class Loaded(NamedTuple):
    state: PolicyState
    identities: StaticIdentities
    resolver: Resolver
    addresses: AddressPolicy


def log_to_stderr() -> None:
    """Umbra's own errors (hook failures, refused bundles, failed releases) go to the proxy's
    stderr; mitmproxy's handlers only cover its own loggers."""
    umbra_logger = logging.getLogger("umbra")
    if not umbra_logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("umbra %(levelname)s %(name)s: %(message)s"))
        umbra_logger.addHandler(handler)
        umbra_logger.setLevel(logging.INFO)


def config_evidence(config: ProxyConfig, purpose: str) -> Evidence:
    """This TD's quote source (and event log) as the options name them; StartupError if not."""
    try:
        return build_evidence(
            config.quote_source,
            event_log=config.event_log,
            simulated_pki=config.simulated_pki,
            simulated_image=config.simulated_image,
            tdx_quote_socket=config.tdx_quote_socket,
        )
    except EvidenceError as exc:
        raise StartupError(f"{purpose}: {exc}") from None


def tunnel_evidence(config: ProxyConfig) -> Evidence | None:
    """Evidence is needed by the tunnel endpoint and by the secret puller, and only by them."""
    if config.tunnel_listen_host is None and not config.secrets_from_console:
        return None
    return config_evidence(config, "attestation evidence")


def collateral_relay(config: ProxyConfig) -> CollateralProvider | None:
    """The tunnel endpoint's own collateral, sent with its quote (`--tunnel-collateral-pccs`)."""
    if not config.tunnel_collateral_pccs:
        return None
    return logged(CollateralRelay(PccsCollateral(config.tunnel_collateral_pccs)))


def logged(relay: CollateralRelay) -> CollateralProvider:
    """`relay`, saying once per change when a fetch fails and when nothing can be sent: the
    forwarders then refuse us (`collateral_missing`), and the operator must see why here."""
    said: list[str | None] = [None]

    async def provide(raw_quote: bytes) -> bytes | None:
        data = await relay(raw_quote)
        error = relay.last_error
        if error != said[0]:
            said[0] = error
            if error is None:
                logging.getLogger(__name__).warning(
                    "tunnel collateral: fetched again after failing"
                )
            else:
                logging.getLogger(__name__).warning(
                    "tunnel collateral: fetch failed (%s); %s",
                    error,
                    "still sending the held set" if data is not None else "sending none",
                )
        return data

    return provide


def console_verify(config: ProxyConfig) -> ssl.SSLContext | bool:
    """TLS trust for the Console: exactly `--console-ca` when given, else the public CAs."""
    if config.console_ca is None:
        return True
    try:
        return ssl.create_default_context(cafile=str(config.console_ca))
    except (OSError, ssl.SSLError) as exc:
        raise StartupError(f"{config.console_ca}: not a readable CA certificate: {exc}") from None


def console_client(config: ProxyConfig) -> httpx.AsyncClient | None:
    """One HTTP client for the Console, carrying this Security CVM's credential."""
    path = config.console_credential_file
    if config.console_url is None or path is None:
        return None
    try:
        credential = path.read_text().strip()
    except OSError as exc:
        raise StartupError(f"{path}: cannot read the Console credential ({exc.strerror})") from None
    if not credential or any(ord(char) < 0x21 or ord(char) > 0x7E for char in credential):
        raise StartupError(f"{path}: the Console credential must be one printable token")
    return httpx.AsyncClient(
        timeout=10,
        headers={"Authorization": f"Bearer {credential}"},
        verify=console_verify(config),
    )


def load(config: ProxyConfig) -> Loaded:
    """Policy state (with secrets), identities, resolver and address policy, as configured."""
    try:
        secrets = SecretStore.from_file(config.secrets) if config.secrets else SecretStore.empty()
        identities = StaticIdentities.from_file(config.identities)
        state = PolicyState(secrets)
        if config.policy_dir is not None:
            state.install(policy_set=load_policy_dir(config.policy_dir))
        keys = [load_public_key(path) for path in config.bundle_keys]
        if config.bundle is not None:
            from umbra.proxy.puller import accept_bundle

            state.install(bundle=accept_bundle(config.bundle.read_bytes(), keys, None))
    except (PolicyError, BundleError, OSError) as exc:
        raise StartupError(f"cannot load policy: {exc}") from None
    except Exception as exc:
        raise StartupError(str(exc)) from None
    resolver: Resolver = SystemResolver()
    if config.test_resolver:
        resolver = StaticResolver.from_file(config.test_resolver)
    elif config.test_hosts:
        resolver = OverlayResolver(StaticResolver.from_file(config.test_hosts), resolver)
    allow: list[IPNetwork] = [ipaddress.ip_network(cidr) for cidr in config.test_allow_upstream]
    if allow or config.test_resolver or config.test_hosts or config.test_clock:
        _warn_test_only(config, allow)
    return Loaded(state, identities, resolver, AddressPolicy(test_allow=tuple(allow)))


def _warn_test_only(config: ProxyConfig, allow: list[IPNetwork]) -> None:
    print(
        "!" * 78
        + "\nWARNING: TEST-ONLY OPTIONS ACTIVE: "
        + ", ".join(
            [f"--test-allow-upstream {net}" for net in allow]
            + (["--test-resolver"] if config.test_resolver else [])
            + (["--test-hosts"] if config.test_hosts else [])
            + (["--test-clock"] if config.test_clock else [])
        )
        + "\nThis proxy may reach addresses a production proxy refuses. Never deploy this.\n"
        + "!" * 78,
        file=sys.stderr,
        flush=True,
    )
