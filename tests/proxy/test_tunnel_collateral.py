"""`umbra proxy serve --tunnel-collateral-pccs`: the Security CVM's tunnel endpoint sends the
collateral for its own quote, so a forwarder configured with no PCCS at all (`collateral:
{relayed: true}`, a cloud Dev CVM's) verifies it and its sandbox's request goes through:

    sandbox client ─▶ Forwarder (verifier from its config) ─aTLS─▶ `umbra proxy serve`
    (simulated TEE, relay fetching from a loopback PCCS) ─▶ the real proxy ─▶ loopback origin
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
import time
import uuid
from pathlib import Path

import pytest

from umbra.attest.eventlog import dump_dstack_event_log
from umbra.attest.simpccs import SimulatedPccs
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx
from umbra.sandbox.forwarder import Forwarder
from umbra.sandbox.forwarder_config import ForwarderConfig
from umbra.sandbox.forwarder_setup import build_verifier
from umbra.sandbox.models import Endpoint

from .conftest import Env
from .harness import ALICE_TOKEN, free_port, read_response, start_proxy, status_of

COMPOSE_EVENT = ("compose-hash", bytes.fromhex("cd" * 32))


def _get_via(env: Env, port: int, ca: Path, path: str) -> bytes:
    target = f"api.test:{env.origin.port}"
    sock = socket.create_connection(("127.0.0.1", port), timeout=20)
    sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    response = read_response(sock, timeout=20)
    if status_of(response) != 200:
        sock.close()
        return response
    with ssl.create_default_context(cafile=str(ca)).wrap_socket(
        sock, server_hostname="api.test"
    ) as tls:
        tls.sendall(f"GET {path} HTTP/1.1\r\nHost: {target}\r\nConnection: close\r\n\r\n".encode())
        return read_response(tls, timeout=20)


def test_forwarder_with_no_pccs_verifies_the_security_cvm_by_its_relayed_collateral(
    env: Env, tmp_path: Path
) -> None:
    pki = SimulatedPki.generate()
    pki.save(tmp_path / "pki")
    (tmp_path / "root.der").write_bytes(pki.root_der)
    tdx = SimulatedTdx(pki, image="umbra-security-cvm")
    tdx.extend_runtime_event(*COMPOSE_EVENT)
    (tmp_path / "event_log.json").write_text(dump_dstack_event_log(tdx.event_log()))
    release = tdx.release_manifest(
        events=[{"name": COMPOSE_EVENT[0], "payloads": [COMPOSE_EVENT[1].hex()]}]
    )
    tunnel_port = free_port()
    with SimulatedPccs(pki, int(time.time()) - 60) as pccs:
        proxy = start_proxy(
            [
                "--policy-dir", str(env.policy_dir),
                "--identities", str(env.identities),
                "--secrets", str(env.secrets),
                "--upstream-ca", str(env.ca.cert_path),
                "--test-allow-upstream", "127.0.0.1/32",
                "--test-resolver", str(env.resolver),
                "--tunnel-listen", f"127.0.0.1:{tunnel_port}",
                "--quote-source", "simulated",
                "--simulated-pki", str(tmp_path / "pki"),
                "--event-log", str(tmp_path / "event_log.json"),
                "--tunnel-collateral-pccs", pccs.url,
            ],
            tmp_path,
        )  # fmt: skip
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        try:
            cfg = ForwarderConfig.model_validate(
                {
                    "apiVersion": "umbra/v1",
                    "kind": "ForwarderConfig",
                    "listen": {"host": "127.0.0.1", "proxy_port": free_port()},
                    "security_cvm": {"host": "127.0.0.1", "port": tunnel_port},
                    "security_cvm_release": release.model_dump(mode="json", exclude_none=True),
                    "collateral": {"relayed": True},
                    "allow_simulated": True,
                    "simulated_root": str(tmp_path / "root.der"),
                    "cvm_id_file": str(tmp_path / "cvm-id"),
                }
            )
            fwd = Forwarder(
                cvm_id="cvm-alice",
                security_cvm=Endpoint(host="127.0.0.1", port=tunnel_port),
                verifier=build_verifier(cfg),
                listen_host="127.0.0.1",
                proxy_port=cfg.listen.proxy_port,
                credential=ALICE_TOKEN,
                connect_timeout=5,
                handshake_timeout=20,
            )
            asyncio.run_coroutine_threadsafe(fwd.start(), loop).result(30)
            needles = [f"relayed-{uuid.uuid4().hex}" for _ in range(2)]
            for needle in needles:
                response = _get_via(env, fwd.ports()[0], proxy.ca, f"/{needle}")
                assert status_of(response) == 200, response[:300]
                assert env.recorder.contains(needle.encode())
            assert fwd.stats.refused == {}
            # The proxy fetched the set once (kept for both sessions); nobody else asked.
            tcb = [p for p in pccs.requests if p.startswith("/tdx/certification/v4/tcb?")]
            assert len(tcb) == 1, pccs.requests
        finally:
            asyncio.run_coroutine_threadsafe(fwd.close(), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
            output = proxy.stop()
    assert "umbra tunnel endpoint listening" in output


def test_collateral_pccs_needs_the_tunnel_and_a_url() -> None:
    from pydantic import ValidationError

    from umbra.proxy.config import ProxyConfig

    base = {"policy_dir": "/p", "identities": "/i", "traffic_log": "/t", "confdir": "/c"}
    with pytest.raises(ValidationError, match="needs --tunnel-listen"):
        ProxyConfig.model_validate({**base, "tunnel_collateral_pccs": ["https://pccs.example"]})
    with pytest.raises(ValidationError, match="is not an http"):
        ProxyConfig.model_validate(
            {**base, "tunnel_listen_host": "127.0.0.1", "tunnel_collateral_pccs": ["ftp://x"]}
        )
