"""The Security CVM as a VM on the emulated cloud, launched through a real Console.

The Console (SQLite, TLS with its own CA) has the `qemu` provider (console/providers_qemu.py)
configured with the `qemu` OS image built as a Security CVM boots it (Docker, docker-compose, the
session's proxy image archive: tests/images/conftest.py `cvm_disk`) and the Security
release's app-compose (`tee: simulated`, `simulated.source: emulated`). An admin launches a
Security CVM through the API; the provider renders its launch data with the components' code and
boots QEMU (TCG) in the GCP shape with the host's simulated TDX module as its TEE. In the guest the
launch agent measures into the module, starts the quote relay and runs the measured compose under
Docker (the archive loaded, nothing pulled); the proxy enrolls at the Console with the one-time
token (its quote verified against the Security release), pulls the signed bundle and the Dev
CVM's attachment.

On the host a real `Forwarder` (a Dev CVM's, with a credential the Console issued after its own
simulated enrollment) attests the VM's tunnel endpoint through QEMU's host forward — aTLS, the
module's quote and the agent's event log verified against the Security release; the simulated
root is allowed only because the release is `tee: simulated` — and sends an allowed and a denied
request through it to an origin on the emulated network (a guest forward to a loopback server).
The proxy's records reach the Console, attributed to the Dev CVM, its owner and team.

One test, ~15-25 min under TCG on the 2-core CI runner (docstring of the boot figures:
docs/specs/images.md "Emulated clouds"). Run under `flock /tmp/umbra-heavy.lock` locally.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.console import enroll
from tests.console.helpers import new_team, start_server
from tests.console.oidc_issuer import LocalIssuer
from tests.proxy import harness
from umbra.attest.collateral import StaticCollateral
from umbra.attest.measurement import MeasurementPolicy
from umbra.attest.simpccs import SimulatedPccs
from umbra.attest.simpki import SimulatedPki
from umbra.attest.verify import Verifier
from umbra.console.providers_qemu import QemuCvmProvider, QemuCvmSettings
from umbra.console.release import AttestedReleaseVerifier
from umbra.emulated.metadata import Shape
from umbra.images.measure import measure
from umbra.policy.bundle import generate_key, payload_document, sign_bundle
from umbra.policy.loader import load_policy_dir
from umbra.sandbox.forwarder import Forwarder
from umbra.sandbox.forwarder_config import ForwarderConfig
from umbra.sandbox.forwarder_setup import build_verifier
from umbra.sandbox.models import Endpoint

from ..proxy.harness import read_response, status_of
from ..sandbox.fixtures import security_definition
from .test_qemu_boot import _need_qemu

pytestmark = pytest.mark.timeout(3600)
ACCEL = os.environ.get("UMBRA_TEST_ACCEL", "tcg")
BOOT_LIMIT = 1800.0
# The emulated network's other hosts (inside 168.0.0.0/6, relayed to loopback by QEMU).
CONSOLE_ADDR, ORIGIN_ADDR = "168.1.0.10", "168.1.0.20"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def _origin(paths: list[str]) -> Iterator[int]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            return None

        def do_GET(self) -> None:
            paths.append(self.path)
            body = b"security-vm-origin-ok"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def _get(port: int, url: str) -> bytes:
    """An absolute-form plain HTTP request through the forwarder's proxy port."""
    host = url.split("/")[2]
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        sock.sendall(f"GET {url} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        return read_response(sock, timeout=300)


def _serial(run: Path, cvm_id: str, boot: int) -> str:
    path = run / cvm_id / f"serial-{boot}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def test_a_console_launched_security_cvm_boots_attests_and_serves_egress(
    cvm_disk: tuple[Path, dict[str, dict[str, str]]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _need_qemu()
    disk, images = cvm_disk
    pki = SimulatedPki.generate()
    pki.save(tmp_path / "pki")
    (tmp_path / "root.der").write_bytes(pki.root_der)
    ca = harness.TestCA(tmp_path)
    # The guest reaches the Console at CONSOLE_ADDR:443; the host's clients at 127.0.0.1.
    cert, key = ca.issue(["console.umbra.test"], ips=("127.0.0.1", CONSOLE_ADDR))
    monkeypatch.setenv("SSL_CERT_FILE", str(ca.cert_path))
    issuer = LocalIssuer()
    db = tmp_path / "console.db"
    server = start_server("sqlite", f"sqlite:///{db}", db, issuer.url, generate_key(), tmp_path,
                          tls=(cert, key, "127.0.0.1"))  # fmt: skip
    console_port = int(server.url.rsplit(":", 1)[1])
    origin_paths: list[str] = []
    provider: QemuCvmProvider | None = None
    sec_id = ""
    try:
        with (
            _origin(origin_paths) as origin_port,
            SimulatedPccs(pki, int(time.time()) - 60) as pccs,
        ):
            team = new_team(server, issuer)
            keys = [Path(k).read_text() for k in server.settings.bundle_public_keys]
            definition = security_definition(
                images={"proxy": f"umbra/proxy@{images['proxy']['manifest_digest']}"},
                console_url=f"https://{CONSOLE_ADDR}",
                console_ca=True,
                bundle_keys=keys,
                simulated={"source": "emulated"},
                test_options={
                    "allow_upstream": [f"{ORIGIN_ADDR}/32"],
                    "resolver": {"origin.test": [ORIGIN_ADDR], "denied.test": [ORIGIN_ADDR]},
                },
            )
            measured = measure(definition)
            release = measured.release
            # The Console admits this Security CVM (enrollment, secret release) only for the
            # measured release on the simulated root: its quotes come from the VM's module.
            verifier = AttestedReleaseVerifier(
                Verifier(
                    MeasurementPolicy(release=release),
                    StaticCollateral(pki.collateral(int(time.time()) - 3600)),
                    allow_simulated=True,
                    simulated_root_der=pki.root_der,
                )
            )
            server.console.enrollment_verifiers["security"] = verifier
            server.console.release_verifier = verifier
            app_compose = tmp_path / "security-app-compose.json"
            app_compose.write_bytes(measured.app_compose)
            tunnel_host_port = _free_port()
            run = tmp_path / "vms"
            provider = QemuCvmProvider(
                QemuCvmSettings.model_validate(
                    {
                        "shape": Shape.gcp, "disk": disk, "app_compose": app_compose,
                        "runtime_dir": run, "accel": ACCEL, "data_disk_gb": 1,
                        "console_url": f"https://{CONSOLE_ADDR}", "console_ca": ca.cert_path,
                        "simulated_pki": tmp_path / "pki",
                        "security_app_compose": app_compose,
                        "security_tunnel_host_port": tunnel_host_port,
                        "forwards": [
                            {"address": CONSOLE_ADDR, "port": 443, "host_port": console_port},
                            {"address": ORIGIN_ADDR, "port": 80, "host_port": origin_port},
                        ],
                    }
                )
            )  # fmt: skip
            server.console.providers["qemu"] = provider
            # The policy: origin.test over HTTP on port 80, nothing else.
            policies = tmp_path / "policies"
            policies.mkdir()
            (policies / "testing.yaml").write_text(
                "apiVersion: umbra/v1\nkind: Profile\nname: testing\negress:\n"
                "  - id: origin\n    allow: {hosts: [origin.test], schemes: [http], ports: [80]}\n"
            )
            compiled = [p.compiled for p in load_policy_dir(policies).profiles.values()]
            bundle = sign_bundle(payload_document(compiled, 1, "svm"), [server.bundle_key])
            assert team.upload(1, bundle).status_code == 201
            start = time.monotonic()
            made = team.admin.post(f"/api/v1/teams/{team.name}/cvms",
                                   json={"name": "sec-vm", "kind": "security", "provider": "qemu"})  # fmt: skip
            assert made.status_code == 201, made.text
            sec_id = made.json()["id"]
            dev = team.dev.post(f"/api/v1/teams/{team.name}/cvms",
                                json={"name": "dev-1", "security_cvm_id": sec_id})  # fmt: skip
            assert dev.status_code == 201, dev.text
            dev_id = dev.json()["id"]
            attached = team.admin.put(f"/api/v1/cvms/{dev_id}/profiles",
                                      json={"profiles": ["testing"]})  # fmt: skip
            assert attached.status_code == 200, attached.text
            credential = enroll.enroll(server.url, team.admin, dev_id, enroll.DEV_IMAGE, tmp_path)
            text = ""
            started = f"umbra-launch: security-cvm {sec_id} started, compose-hash"
            while started not in text and time.monotonic() - start < BOOT_LIMIT:
                time.sleep(5)
                text = _serial(run, sec_id, 1)
                assert "REFUSED" not in text, text[-3000:]
            assert started in text, text[-3000:]
            compose_up = time.monotonic() - start
            print(f"launch to compose started: {compose_up:.0f} s")
            assert "umbra-launch: TDX quote relay started for the proxy" in text
            assert "formatted (it was empty) and mounted" in text  # the spool's data disk
            _through_the_attested_tunnel(
                tunnel_host_port, release.model_dump(mode="json", exclude_none=True),
                pccs.url, tmp_path, dev_id, credential, origin_paths, start,
            )  # fmt: skip
            records = _traffic(team, dev_id)
            print("traffic:", [(r.get("host"), r.get("path"), r.get("decision")) for r in records])
            allowed = [r for r in records if r.get("path") == "/allowed"]
            assert allowed and allowed[0]["cvm_id"] == dev_id
            assert allowed[0]["owner"] == team.dev_subject and allowed[0]["team"] == team.name
            assert any(r.get("decision") == "deny" for r in records)
            info = team.admin.get(f"/api/v1/cvms/{sec_id}").json()
            assert info["provider_state"]["tunnel"] == f"127.0.0.1:{tunnel_host_port}"
            # A reboot (stop: the ACPI power button; start: the same disks): the spool is on the
            # data disk, found again by label; the proxy re-enrolls by a fresh quote (its
            # credential was in tmpfs, the token is spent) and serves again.
            _set_power(team, sec_id, "stopped")
            spool = _debugfs(run / sec_id / "data.raw", "ls -l /spool")
            print("data disk after the stop:", spool)
            assert "No such file" not in spool and "65534" in _debugfs(
                run / sec_id / "data.raw", "stat /spool"
            )
            start = time.monotonic()
            _set_power(team, sec_id, "running")
            text = ""
            while started not in text and time.monotonic() - start < BOOT_LIMIT:
                time.sleep(5)
                text = _serial(run, sec_id, 2)
                assert "REFUSED" not in text, text[-3000:]
            assert started in text, text[-3000:]
            print(f"start to compose started (boot 2): {time.monotonic() - start:.0f} s")
            assert "umbra-launch: data disk /dev/vdb mounted at" in text, text[-3000:]
            _through_the_attested_tunnel(
                tunnel_host_port, release.model_dump(mode="json", exclude_none=True),
                pccs.url, tmp_path, dev_id, credential, origin_paths, start,
            )  # fmt: skip
            team.close()
    finally:
        if provider is not None:
            for vm_id in list(provider._vms):
                print(f"serial tail ({vm_id}):\n" + _serial(tmp_path / "vms", vm_id, 1)[-2500:])
                vm = provider._vms[vm_id]
                if vm.qemu is not None:
                    vm.qemu.kill()
                vm.stand_in.stop()
                vm.module.close()
        server.stop()
        issuer.close()


def _through_the_attested_tunnel(
    tunnel_port: int,
    release: dict[str, Any],
    pccs_url: str,
    d: Path,
    dev_id: str,
    credential: str,
    origin_paths: list[str],
    start: float,
) -> None:
    """A Dev CVM's forwarder on the host: attests the VM's tunnel endpoint (the module's quote,
    the agent's event log, the Security release, the simulated root), then an allowed and a
    denied request through it."""
    (d / "dev-cvm-id").write_text(dev_id + "\n")
    cfg = ForwarderConfig.model_validate(
        {
            "apiVersion": "umbra/v1",
            "kind": "ForwarderConfig",
            "listen": {"host": "127.0.0.1", "proxy_port": _free_port()},
            "security_cvm": {"host": "127.0.0.1", "port": tunnel_port},
            "security_cvm_release": release,
            "collateral": {"pccs_urls": [pccs_url]},
            "allow_simulated": True,
            "simulated_root": str(d / "root.der"),
            "cvm_id_file": str(d / "dev-cvm-id"),
        }
    )
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    fwd = Forwarder(
        cvm_id=dev_id,
        security_cvm=Endpoint(host="127.0.0.1", port=tunnel_port),
        verifier=build_verifier(cfg),
        listen_host="127.0.0.1",
        proxy_port=cfg.listen.proxy_port,
        credential=credential,
        connect_timeout=30,
        handshake_timeout=300,
    )
    try:
        asyncio.run_coroutine_threadsafe(fwd.start(), loop).result(30)
        port = fwd.ports()[0]
        response = b""
        # The proxy comes up after Docker loads its image and it enrolls: retried until then.
        while time.monotonic() - start < BOOT_LIMIT:
            response = _get(port, "http://origin.test/allowed")
            if status_of(response) == 200:
                break
            time.sleep(10)
        print(f"launch to the first request through the tunnel: {time.monotonic() - start:.0f} s")
        assert status_of(response) == 200, (response[:500], fwd.stats.refused)
        assert response.endswith(b"security-vm-origin-ok")
        # A 200 is relayed only after the tunnel endpoint attested. While the VM booted, QEMU's
        # host forward accepted and reset connections (counted as refusals): none after this.
        booting = dict(fwd.stats.refused)
        denied = _get(port, "http://denied.test/secret-path")
        assert status_of(denied) == 403, denied[:500]
        assert "/allowed" in origin_paths and "/secret-path" not in origin_paths
        assert re.search(rb"umbra", denied, re.IGNORECASE)
        assert fwd.stats.refused == booting, (booting, fwd.stats.refused)
    finally:
        asyncio.run_coroutine_threadsafe(fwd.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


def _set_power(team: Any, cvm_id: str, state: str) -> None:
    done = team.admin.patch(f"/api/v1/cvms/{cvm_id}", json={"state": state})
    assert done.status_code == 200, done.text
    deadline = time.monotonic() + 420  # an ACPI stop under TCG: up to the provider's 300 s
    info: dict[str, Any] = {}
    while time.monotonic() < deadline:
        info = team.admin.get(f"/api/v1/cvms/{cvm_id}").json()
        if info["state"] == state:
            return
        time.sleep(2)
    raise AssertionError(f"{cvm_id} never became {state}: {info}")


def _debugfs(image: Path, request: str) -> str:
    done = subprocess.run(["debugfs", "-R", request, str(image)],
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    return done.stdout + done.stderr


def _traffic(team: Any, dev_id: str) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    for _ in range(120):  # shipped about every second; slower under TCG
        page = team.admin.get(
            f"/api/v1/teams/{team.name}/traffic", params={"cvm_id": dev_id, "limit": 100}
        ).json()
        records = page["records"]
        if any(r.get("path") == "/allowed" for r in records) and any(
            r.get("decision") == "deny" for r in records
        ):
            return records
        time.sleep(2)
    return records
