"""Relayed collateral under the Dev CVM's real host ruleset (loaded with nft, the lab of
test_host_firewall.py): the forwarder reaches no PCCS, yet verifies its Security CVM, because
the tunnel endpoint sends the collateral it fetched through the cloud network. The relay adds
nothing to the ruleset: the forwarder's only path is the tunnel port it already had."""

from __future__ import annotations

import asyncio
import os
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.infra.test_host_firewall import SEC, WEB, Lab
from tests.sandbox.netns import LoopIn, run_in
from umbra.attest.collateral import CollateralRelay, PccsCollateral
from umbra.attest.quote_source import SimulatedSource
from umbra.attest.simpccs import SimulatedPccs
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx
from umbra.components.ports import SECURITY_TUNNEL_PORT
from umbra.proxy.identity import CvmEntry, StaticIdentities, hash_credential
from umbra.proxy.tunnel import TunnelEndpoint
from umbra.proxy.tunnel_identities import TunnelIdentities
from umbra.sandbox.forwarder import Forwarder
from umbra.sandbox.forwarder_config import ForwarderConfig
from umbra.sandbox.forwarder_setup import build_verifier
from umbra.sandbox.models import Endpoint

from .test_host_firewall import pytestmark as _needs_root

pytestmark = _needs_root
CVM, CREDENTIAL = "dev-c", "relayed-collateral-credential-01"
CA_PEM = b"-----BEGIN CERTIFICATE-----\nstand-in\n-----END CERTIFICATE-----\n"
COMPOSE = bytes(range(32))


class QuietLab(Lab):
    """The same namespaces and ruleset, without the decoy servers (the tunnel port is ours)."""

    def serve(self, ns: str, *specs: str) -> None:
        pass


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    lab = QuietLab(f"ucl{os.getpid() % 100000}")
    try:
        lab.up()
        lab.load_dev_ruleset("gcp", tmp_path / "host.nft")
        yield lab
    finally:
        lab.down()


def _dial(host: str, port: int) -> str:
    try:
        socket.create_connection((host, port), timeout=1).close()
        return "connected"
    except OSError as exc:
        return type(exc).__name__


def test_forwarder_verifies_with_relayed_collateral_and_reaches_no_pccs(
    lab: Lab, tmp_path: Path
) -> None:
    pki = SimulatedPki.generate()
    tdx = SimulatedTdx(pki, image="umbra-security-cvm")
    tdx.extend_runtime_event("compose-hash", COMPOSE)
    (tmp_path / "root.der").write_bytes(pki.root_der)
    (tmp_path / "ca.pem").write_bytes(CA_PEM)
    release = tdx.release_manifest(events=[{"name": "compose-hash", "payloads": [COMPOSE.hex()]}])
    cloud, dev = LoopIn(lab.ns["n"]), LoopIn(lab.ns["f"])
    # A PCCS on the cloud network (the Intel PCS stand-in), which the Security CVM reaches.
    pccs = run_in(
        lab.ns["n"], lambda: SimulatedPccs(pki, int(time.time()) - 60, host=WEB).__enter__()
    )
    try:
        collateral = pccs.collateral

        async def fetch(url: str, raw_quote: bytes) -> Any:
            # dcap-qvl's HTTP client runs on a process-wide runtime whose threads keep the
            # network namespace of the thread that first used it (another test's, in a full
            # run): the TCB info is fetched here instead, over HTTP from this loop's own
            # namespace (the cloud network's), and the PCCS's set is what the relay holds.
            tcb = f"{url}/tdx/certification/v4/tcb?fmspc={collateral.fmspc}"
            await asyncio.to_thread(lambda: urllib.request.urlopen(tcb, timeout=5).read())  # noqa: S310 -- http to the stand-in
            return collateral.qvl

        relay = CollateralRelay(PccsCollateral([pccs.url], fetch=fetch))
        endpoint = TunnelEndpoint(
            identities=StaticIdentities(
                [
                    CvmEntry(
                        cvm_id=CVM,
                        owner="o",
                        team="t",
                        profiles=[],
                        credential_sha256=hash_credential(CREDENTIAL),
                    )
                ]
            ),
            registry=TunnelIdentities(),
            proxy_host="127.0.0.1",
            proxy_port=9,
            emit=lambda record: None,
            ca_file=tmp_path / "ca.pem",
            collateral=relay,
        )
        cloud.run(endpoint.serve(SEC, SECURITY_TUNNEL_PORT, SimulatedSource(tdx), tdx.event_log))
        cfg = ForwarderConfig.model_validate(
            {
                "apiVersion": "umbra/v1",
                "kind": "ForwarderConfig",
                "listen": {"host": "127.0.0.1", "proxy_port": 3128},
                "security_cvm": {"host": SEC, "port": SECURITY_TUNNEL_PORT},
                "security_cvm_release": release.model_dump(mode="json", exclude_none=True),
                "collateral": {"relayed": True},
                "allow_simulated": True,
                "simulated_root": str(tmp_path / "root.der"),
                "cvm_id_file": str(tmp_path / "cvm-id"),
            }
        )
        fwd = Forwarder(
            cvm_id=CVM,
            security_cvm=Endpoint(host=SEC, port=SECURITY_TUNNEL_PORT),
            verifier=build_verifier(cfg),
            listen_host="127.0.0.1",
            proxy_port=0,
            credential=CREDENTIAL,
            connect_timeout=5,
            handshake_timeout=20,
        )
        assert dev.run(fwd.fetch_ca()) == CA_PEM, fwd.stats.refused
        assert relay.fetches == 1 and pccs.requests
        # The PCCS is there for the Security CVM, and not for the forwarder: the host ruleset
        # drops it (a timeout, not a refusal: nothing answers for the dropped SYN).
        port = int(pccs.url.rsplit(":", 1)[1].split("/")[0])
        assert run_in(lab.ns["n"], lambda: _dial(WEB, port)) == "connected"
        assert run_in(lab.ns["f"], lambda: _dial(WEB, port)) in ("TimeoutError", "timeout")
    finally:
        dev.stop()
        cloud.stop()
        run_in(lab.ns["n"], lambda: pccs.__exit__(None, None, None))
