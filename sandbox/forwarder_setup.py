"""Build a Forwarder from its config file: the verifier, the launch-bound identity, the dialer."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from umbra.attest.collateral import (
    Collateral,
    CollateralCache,
    CollateralSource,
    PccsCollateral,
    RelayedCollateral,
    StaticCollateral,
)
from umbra.attest.errors import AttestError
from umbra.attest.measurement import MeasurementPolicy
from umbra.attest.verify import Verifier
from umbra.sandbox.forwarder import Forwarder
from umbra.sandbox.forwarder_config import (
    ForwarderConfig,
    ForwarderConfigError,
    read_credential,
    read_cvm_id,
    read_first_ipv4,
)
from umbra.sandbox.models import Endpoint
from umbra.sandbox.privileges import PrivilegeError, drop_to
from umbra.sandbox.sandbox_ca import CaBundle


def build_verifier(cfg: ForwarderConfig, cache_dir: Path | None = None) -> Verifier:
    collateral: CollateralSource
    try:
        if cfg.collateral.file is not None:
            collateral = StaticCollateral(Collateral.from_file(cfg.collateral.file))
        elif cfg.collateral.relayed:
            collateral = RelayedCollateral()
        else:
            collateral = PccsCollateral(cfg.collateral.pccs_urls, cache=CollateralCache(cache_dir))
    except AttestError as exc:
        raise ForwarderConfigError(f"collateral: {exc}") from None
    root: bytes | None = None
    if cfg.simulated_root is not None:
        try:
            root = cfg.simulated_root.read_bytes()
        except OSError as exc:
            raise ForwarderConfigError(f"{cfg.simulated_root}: {exc.strerror}") from None
    return Verifier(
        MeasurementPolicy(release=cfg.security_cvm_release),
        collateral,
        allow_simulated=cfg.allow_simulated,
        simulated_root_der=root,
    )


def security_endpoint(cfg: ForwarderConfig) -> Endpoint:
    """Where to dial the Security CVM: the launch agent's address when the config names the
    file and launch data gave one (a cloud Dev CVM resolves nothing), else the configured host
    (launch data without Security CVM addresses: there is no host ruleset either, and a name
    that resolves nowhere fails closed at the dial). Never trusted: the peer must attest."""
    if cfg.security_cvm_ips_file is None or not cfg.security_cvm_ips_file.exists():
        return cfg.security_cvm
    address = read_first_ipv4(cfg.security_cvm_ips_file, "Security CVM")
    return Endpoint(host=address, port=cfg.security_cvm.port)


def build_forwarder(cfg: ForwarderConfig) -> Forwarder:
    return Forwarder(
        cvm_id=read_cvm_id(cfg.cvm_id_file),
        credential=read_credential(cfg.credential_file) if cfg.credential_file else None,
        security_cvm=security_endpoint(cfg),
        verifier=build_verifier(cfg),
        listen_host=cfg.listen.host,
        proxy_port=cfg.listen.proxy_port,
        tunnels=cfg.listen.tunnels,
        transparent_https=cfg.listen.transparent.https_port if cfg.listen.transparent else None,
        transparent_http=cfg.listen.transparent.http_port if cfg.listen.transparent else None,
        dns_port=cfg.listen.dns_port,
        connect_timeout=cfg.connect_timeout,
        handshake_timeout=cfg.handshake_timeout,
        max_connections=cfg.max_connections,
        ca_bundle=CaBundle.load(cfg.sandbox_ca.file) if cfg.sandbox_ca else None,
        ca_refresh=cfg.sandbox_ca.refresh if cfg.sandbox_ca else 300.0,
        env_file=cfg.sandbox_env.file if cfg.sandbox_env else None,
        env_base=dict(cfg.sandbox_env.base) if cfg.sandbox_env else {},
        env_refresh=cfg.sandbox_env.refresh if cfg.sandbox_env else 3.0,
    )


# asyncio's default executor (getaddrinfo, to_thread) and str hostnames' IDNA codec.
_LAZY_IMPORTS = ("concurrent.futures.thread", "encodings.idna")


def drop_forwarder_privileges(forwarder: Forwarder, uid: int) -> None:
    """Once enrolled and bound: run on as `uid`. The only files it still writes are the sandbox's
    CA bundle and its environment file, so their directories become the uid's and are reached
    through descriptors opened now (their parents, the CVM's 0700 state directory, stay closed to
    the uid). The credential file stays root's 0600: read at start, never again."""
    # What serving imports lazily must be loaded now: the interpreter's own files may be closed
    # to the uid (a Python under root's 0700 home); on a CVM they are world-readable anyway.
    for module in _LAZY_IMPORTS:
        importlib.import_module(module)
    bundle = forwarder.ca_bundle
    if bundle is not None:
        bundle.path = _kept_writable(bundle.path, uid)
    if forwarder.env_file is not None:
        forwarder.env_file = _kept_writable(forwarder.env_file, uid)
    drop_to(uid)


def _kept_writable(path: Path, uid: int) -> Path:
    """`path` as the dropped uid will reach it: its directory made the uid's, through a
    descriptor kept open for the process's life."""
    directory = path.parent
    try:
        os.chown(directory, uid, uid)
        fd = os.open(directory, os.O_PATH | os.O_DIRECTORY)
    except OSError as exc:
        raise PrivilegeError(f"{directory}: {exc.strerror}") from None
    return Path(f"/proc/self/fd/{fd}") / path.name
