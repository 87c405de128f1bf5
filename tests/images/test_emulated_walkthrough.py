"""The emulated cloud's day, through a real Console: a Security CVM and a Dev CVM launched as VMs
of the built `qemu` OS image (both roles, as gcp.yaml ships them: tests/images/conftest.py
`cvm_disk`), under QEMU/TCG by the Console's `qemu` provider in a cloud's shape.

- The Console (SQLite, TLS with its own CA) verifies each kind against its measured release on
  the simulated root (the VMs' TDX modules sign with it; the root is allowed only because both
  releases are `tee: simulated`).
- An admin launches the Security CVM: the agent measures into the VM's module, starts the quote
  relay and the measured compose under Docker (the archive loaded, nothing pulled); the proxy
  enrolls with the one-time token, pulls the signed bundle, and publishes its tunnel endpoint
  on a loopback port of this host.
- The developer launches a Dev CVM with their SSH key: the agent loads the measured host
  firewall, mounts the data disk, starts the dev host (the runc sandbox from the shipped image,
  the forwarder in its namespace) and the attested SSH ingress. The forwarder enrolls at the
  Console (reached by address through a QEMU forward, quoting through the module; the Console
  binds the quote to the launch its provider recorded: keys, ruleset), then attests the
  Security CVM (the release measured into the Dev release, the simulated root the Dev release
  names, the collateral the tunnel endpoint relays from the emulated network's PCCS).
- The real `umbra ssh` attests the Dev CVM's quote and binding and runs commands in the
  sandbox: an allowed request (origin.test, over HTTP through the forwarder and the Security
  CVM's proxy to an origin on the emulated network) and a denied one, then their records in the
  Console, attributed to the Dev CVM, its owner and team; a workspace file.
- A stop and start of both (the ACPI power button; the same disks: new TDs): both re-enroll by a
  fresh quote (no new token), the Security CVM's spool is on its data disk, the workspace file
  is still there and the allowed request works again.

CI runs the GCP shape here, without the stop and start (`UMBRA_TEST_WALKTHROUGH_RESTART=1` adds
it; `UMBRA_TEST_WALKTHROUGH_SHAPES=gcp,azure` for both shapes: each is about 18 min on 2 cores
with it); the Azure shape's day (the agent's other metadata path, IMDS and the wire
server) runs in CI through `umbra up --runtime qemu --check` (tests/up/test_up_qemu_boot.py: both
CVMs VMs of the same image, launched by the developer's own stack). Figures (`BENCH` lines, benchmarks/emulated_walkthrough_bench.py): launch to a working
`umbra ssh`, and start to a working `umbra ssh`. Run under `flock /tmp/umbra-heavy.lock` locally.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization

from tests.console.enroll import release_verifier
from tests.console.helpers import Server, new_team, start_server
from tests.console.oidc_issuer import LocalIssuer
from tests.proxy import harness
from tests.session import harness as session_harness
from tests.session.conftest import Developer, make_developer
from umbra.attest.simpccs import SimulatedPccs
from umbra.attest.simpki import SimulatedPki
from umbra.emulated.metadata import Shape
from umbra.images.measure import Measurement, measure
from umbra.policy.bundle import generate_key, payload_document, sign_bundle
from umbra.policy.loader import load_policy_dir

from ..sandbox.fixtures import dev_definition, security_definition
from .test_qemu_boot import _need_qemu

pytestmark = pytest.mark.timeout(4800)
ACCEL = os.environ.get("UMBRA_TEST_ACCEL", "tcg")
SHAPES = [Shape(s) for s in os.environ.get("UMBRA_TEST_WALKTHROUGH_SHAPES", "gcp").split(",")]
# The stop and start of both (about 10 min under TCG): opt-in, CI leaves it out to stay well under
# its limit; `umbra up --runtime qemu --check` (tests/up/test_up_qemu_boot.py) runs a stop and
# start of both VMs in CI.
RESTART = os.environ.get("UMBRA_TEST_WALKTHROUGH_RESTART") == "1"
BOOT_LIMIT = 1800.0
# The emulated network's other hosts (inside QEMU's 168.0.0.0/6, each relayed to loopback).
CONSOLE_ADDR, SECURITY_ADDR = "168.1.0.10", "168.1.0.20"
ORIGIN_ADDR, PCCS_ADDR = "168.1.0.30", "168.1.0.40"
TUNNEL_PORT = 8443


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
            body = b"emulated-origin-ok"
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


def _releases(pki: SimulatedPki, images: dict[str, dict[str, str]], bundle_pem: str,
              pccs_port: int) -> tuple[Measurement, Measurement]:  # fmt: skip
    """The Security release (its proxy image, the Console by address, the team's bundle key, the
    module's quotes, the emulated network's PCCS, the test origin) and the Dev release that
    measures it (its address, the simulated root, quotes from the module)."""
    sec = measure(
        security_definition(
            images={"proxy": f"umbra/proxy@{images['proxy']['manifest_digest']}"},
            console_url=f"https://{CONSOLE_ADDR}",
            console_ca=True,
            bundle_keys=[bundle_pem],
            simulated={"source": "emulated"},
            pccs_urls=[f"http://{PCCS_ADDR}:{pccs_port}/sgx/certification/v4"],
            test_options={
                "allow_upstream": [f"{ORIGIN_ADDR}/32"],
                "resolver": {"origin.test": [ORIGIN_ADDR], "denied.test": [ORIGIN_ADDR]},
            },
        )
    )
    dev = measure(
        dev_definition(
            security_cvm={"host": SECURITY_ADDR, "port": TUNNEL_PORT},
            security_cvm_release=sec.release.model_dump(mode="json", exclude_none=True),
            pccs_urls=[],
            tunnels=[],
            console_url=f"https://{CONSOLE_ADDR}",
            console_ca=True,
            quote_source="emulated",
            allow_simulated=True,
            simulated_root=pki.root_pem(),
        )
    )
    return sec, dev


@pytest.mark.parametrize("shape", SHAPES)
def test_the_emulated_clouds_day(
    shape: Shape,
    cvm_disk: tuple[Path, dict[str, dict[str, str]]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _need_qemu()
    disk, images = cvm_disk
    pki = SimulatedPki.generate()
    pki.save(tmp_path / "pki")
    ca = harness.TestCA(tmp_path)
    # The guests reach the Console at CONSOLE_ADDR:443; this process and the CLI at 127.0.0.1.
    cert, key = ca.issue(["console.umbra.test"], ips=("127.0.0.1", CONSOLE_ADDR))
    monkeypatch.setenv("SSL_CERT_FILE", str(ca.cert_path))
    bundle_key = generate_key()
    bundle_pem = (
        bundle_key.public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )
    console_port, tunnel_host_port = _free_port(), _free_port()
    issuer = LocalIssuer()
    issuer.token_lifetime = 3 * 3600  # the day's boots outlive the default 10 min
    origin_paths: list[str] = []
    server: Server | None = None
    developer: Developer | None = None
    run = tmp_path / "vms"
    with (
        _origin(origin_paths) as origin_port,
        SimulatedPccs(pki, int(time.time()) - 3600) as pccs,
    ):
        pccs_port = int(pccs.url.rsplit(":", 1)[1].split("/")[0])
        sec, dev = _releases(pki, images, bundle_pem, pccs_port)
        (tmp_path / "security-app-compose.json").write_bytes(sec.app_compose)
        (tmp_path / "dev-app-compose.json").write_bytes(dev.app_compose)
        (tmp_path / "dev-release.json").write_text(dev.release.model_dump_json(exclude_none=True))
        config = tmp_path / "qemu-cvms.json"
        config.write_text(
            json.dumps(
                {
                    "shape": str(shape), "disk": str(disk), "runtime_dir": str(run),
                    "accel": ACCEL, "memory_mb": 1536, "data_disk_gb": 4,
                    "app_compose": str(tmp_path / "dev-app-compose.json"),
                    "release_manifest": str(tmp_path / "dev-release.json"),
                    "security_app_compose": str(tmp_path / "security-app-compose.json"),
                    "security_tunnel_port": TUNNEL_PORT,
                    "security_tunnel_host_port": tunnel_host_port,
                    "console_url": f"https://{CONSOLE_ADDR}",
                    "console_ca": str(ca.cert_path),
                    "simulated_pki": str(tmp_path / "pki"),
                    "console_ips": [CONSOLE_ADDR],
                    "security_cvm_ips": [SECURITY_ADDR],
                    "forwards": [
                        {"address": CONSOLE_ADDR, "port": 443, "host_port": console_port},
                        {"address": SECURITY_ADDR, "port": TUNNEL_PORT,
                         "host_port": tunnel_host_port},
                        {"address": ORIGIN_ADDR, "port": 80, "host_port": origin_port},
                        {"address": PCCS_ADDR, "port": pccs_port, "host_port": pccs_port},
                    ],
                }
            )
        )  # fmt: skip
        db = tmp_path / "console.db"
        server = start_server(
            "sqlite", f"sqlite:///{db}", db, issuer.url, bundle_key, tmp_path,
            tls=(cert, key, "127.0.0.1"), port=console_port,
            providers=["local", "qemu"], qemu_cvm_config=config,
        )  # fmt: skip
        try:
            developer = make_developer(server, issuer, tmp_path / "pki", tmp_path)
            team = new_team(server, issuer, developer.team)
            # Each kind against its own measured release (after new_team: its local Security
            # CVM enrolled with the test verifiers).
            security = release_verifier(sec.release, pki)
            server.console.enrollment_verifiers["security"] = security
            server.console.enrollment_verifiers["dev"] = release_verifier(dev.release, pki)
            server.console.release_verifier = security
            _day(server, team, developer, run, origin_paths, tunnel_host_port)
            team.close()
        finally:
            if developer is not None:
                session_harness.stop_agents(Path(developer.env["TMPDIR"]))
            provider = server.console.providers.get("qemu")
            for vm_id, vm in list(getattr(provider, "_vms", {}).items()):
                print(f"serial tail ({vm_id}):\n" + _serial(run, vm_id, vm.boot)[-2500:])
                if vm.qemu is not None:
                    vm.qemu.kill()
                vm.stand_in.stop()
                vm.module.close()
            server.stop()
            issuer.close()


def _day(server: Server, team: Any, developer: Developer, run: Path, origin_paths: list[str],
         tunnel_host_port: int) -> None:  # fmt: skip
    policies = run.parent / "policies"
    policies.mkdir()
    (policies / "testing.yaml").write_text(
        "apiVersion: umbra/v1\nkind: Profile\nname: testing\negress:\n"
        "  - id: origin\n    allow: {hosts: [origin.test], schemes: [http], ports: [80]}\n"
    )
    compiled = [p.compiled for p in load_policy_dir(policies).profiles.values()]
    bundle = sign_bundle(payload_document(compiled, 1, "day"), [server.bundle_key])
    assert team.upload(1, bundle).status_code == 201

    start = time.monotonic()
    made = team.admin.post(f"/api/v1/teams/{team.name}/cvms",
                           json={"name": "sec-vm", "kind": "security", "provider": "qemu"})  # fmt: skip
    assert made.status_code == 201, made.text
    sec_id = made.json()["id"]
    made = developer.console.client(developer.token).post(
        f"/api/v1/teams/{team.name}/cvms",
        json={"name": "vm1", "provider": "qemu", "security_cvm_id": sec_id,
              "ssh_keys": [developer.pub]},
    )  # fmt: skip
    assert made.status_code == 201, made.text
    dev_id = made.json()["id"]
    attached = team.admin.put(f"/api/v1/cvms/{dev_id}/profiles", json={"profiles": ["testing"]})
    assert attached.status_code == 200, attached.text
    info = team.admin.get(f"/api/v1/cvms/{sec_id}").json()
    assert info["provider_state"]["tunnel"] == f"127.0.0.1:{tunnel_host_port}"

    _wait_serial(run, sec_id, 1, f"umbra-launch: security-cvm {sec_id} started, compose-hash")
    text = _serial(run, sec_id, 1)
    assert "umbra-launch: TDX quote relay started for the proxy" in text
    assert "formatted (it was empty) and mounted" in text  # the spool's data disk
    _wait_audit(team, dev_id, "cvm.enroll", run, 1)
    enrolled = time.monotonic() - start
    first = _in_sandbox(developer, dev_id, run, 1, "echo kept > ~/workspace-file; id -u")
    assert first.split() == ["1000"], first
    ssh = time.monotonic() - start
    _reported_ready(server, run, dev_id, 1)
    assert _status(developer, dev_id, "http://origin.test/allowed", run, 1) == "200"
    served = time.monotonic() - start
    assert _status(developer, dev_id, "http://denied.test/secret-path", run, 1) == "403"
    assert "/allowed" in origin_paths and "/secret-path" not in origin_paths
    # benchmarks/emulated_walkthrough_bench.py reads these lines.
    print(f"BENCH launch enrolled={enrolled:.1f} ssh={ssh:.1f} request={served:.1f}")
    records = _traffic(team, dev_id)
    allowed = [r for r in records if r.get("path") == "/allowed"]
    assert allowed and allowed[0]["cvm_id"] == dev_id, records
    owner = team.admin.get(f"/api/v1/cvms/{dev_id}").json()["owner"]
    assert allowed[0]["owner"] == owner and allowed[0]["team"] == team.name, allowed[0]
    assert any(r.get("decision") == "deny" for r in records), records

    if not RESTART:
        return
    # Stop both (the ACPI power button), then start both on the same disks: new TDs.
    _set_state(team, dev_id, "stopped")
    _set_state(team, sec_id, "stopped")
    spool = _debugfs(run / sec_id / "data.raw", "stat /spool")
    assert "65534" in spool, spool  # the proxy's spool, on the data disk, kept
    start = time.monotonic()
    _set_state(team, sec_id, "running")
    _set_state(team, dev_id, "running")
    _wait_serial(run, sec_id, 2, f"umbra-launch: security-cvm {sec_id} started, compose-hash")
    assert "umbra-launch: data disk /dev/vdb mounted at" in _serial(run, sec_id, 2)
    _wait_audit(team, dev_id, "cvm.reenroll", run, 2)
    enrolled = time.monotonic() - start
    again = _in_sandbox(developer, dev_id, run, 2, "cat ~/workspace-file")
    assert again.strip() == "kept", again
    ssh = time.monotonic() - start
    _reported_ready(server, run, dev_id, 2)
    assert _status(developer, dev_id, "http://origin.test/allowed", run, 2) == "200"
    served = time.monotonic() - start
    print(f"BENCH restart enrolled={enrolled:.1f} ssh={ssh:.1f} request={served:.1f}")
    # Both re-enrolled by a fresh quote: no new token for either (one each, at its launch).
    for cvm_id in (sec_id, dev_id):
        mine = [a for a, e in _actions(team) if e.get("target") == cvm_id]
        assert mine.count("cvm.enrollment_token") == 1 and "cvm.reenroll" in mine, mine


def _reported_ready(server: Server, run: Path, cvm_id: str, boot: int) -> None:
    """The Dev CVM took its cloud's path: launch data read on the cloud's address, the data
    disk (formatted at launch, found by label after), idle stop armed, ready reported (GCP: a
    guest attribute; Azure: the wire server's health report for the goal state)."""
    text = _serial(run, cvm_id, boot)
    found = "formatted (it was empty) and mounted" if boot == 1 else "mounted at"
    assert f"umbra-launch: data disk /dev/vdb {found}" in text, text[-3000:]
    assert "umbra-launch: idle auto-stop armed (60 min)" in text
    vm = server.console.providers["qemu"]._vms[cvm_id]  # type: ignore[attr-defined]
    assert vm.stand_in.wait_ready(boot, 120) is not None, vm.stand_in.requests
    requests = vm.stand_in.requests
    if vm.stand_in.shape is Shape.gcp:
        read = "metadata GET /computeMetadata/v1/instance/attributes/?recursive=true"
        assert requests.count(read) >= boot, requests
    else:
        read = "metadata GET /metadata/instance/compute/userData"
        assert sum(r.startswith(read) for r in requests) >= boot, requests


def _serial(run: Path, cvm_id: str, boot: int) -> str:
    path = run / cvm_id / f"serial-{boot}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def _wait_serial(run: Path, cvm_id: str, boot: int, line: str) -> None:
    deadline = time.monotonic() + BOOT_LIMIT
    text = ""
    while line not in text and time.monotonic() < deadline:
        time.sleep(5)
        text = _serial(run, cvm_id, boot)
        assert "umbra-launch: REFUSED" not in text, text[-3000:]
    assert line in text, text[-3000:]


def _actions(team: Any) -> list[tuple[str, dict[str, Any]]]:
    page = team.admin.get(f"/api/v1/teams/{team.name}/audit", params={"limit": 200}).json()
    entries = page["entries"] if isinstance(page, dict) else page
    return [(e["action"], e) for e in entries]


def _wait_audit(team: Any, cvm_id: str, action: str, run: Path, boot: int) -> None:
    deadline = time.monotonic() + BOOT_LIMIT
    while time.monotonic() < deadline:
        if any(a == action and e.get("target") == cvm_id for a, e in _actions(team)):
            return
        assert "umbra-launch: REFUSED" not in _serial(run, cvm_id, boot)
        time.sleep(5)
    raise AssertionError(
        f"boot {boot}: no {action} for {cvm_id}:\n{_serial(run, cvm_id, boot)[-4000:]}\n"
        f"audit: {[(a, e.get('details')) for a, e in _actions(team)][-12:]}"
    )


def _in_sandbox(developer: Developer, cvm_id: str, run: Path, boot: int, command: str) -> str:
    """`umbra ssh` until the ingress answers (it starts after the dev host), then the output."""
    deadline = time.monotonic() + 900
    done = None
    while time.monotonic() < deadline:
        done = developer.umbra("ssh", cvm_id, "--no-reuse", "--", command, timeout=300)
        if done.returncode == 0:
            return str(done.stdout)
        time.sleep(10)
    assert done is not None
    raise AssertionError(
        f"boot {boot}: umbra ssh failed: {done.stderr}\n{_serial(run, cvm_id, boot)[-4000:]}"
    )


def _status(developer: Developer, cvm_id: str, url: str, run: Path, boot: int) -> str:
    """The HTTP status a request from the sandbox gets (its proxy variables: the forwarder); an
    allowed one retried while the Security CVM's proxy comes up (the forwarder attests it)."""
    want_ok = "allowed" in url
    deadline = time.monotonic() + (BOOT_LIMIT if want_ok else 300)
    code = ""
    while time.monotonic() < deadline:
        code = _in_sandbox(
            developer, cvm_id, run, boot,
            f"curl -sS -m 120 -o /dev/null -w '%{{http_code}}' {url} || true",
        ).strip()[-3:]  # fmt: skip
        if code == "200" or not want_ok:
            return code
        time.sleep(15)
    return code


def _set_state(team: Any, cvm_id: str, state: str) -> None:
    done = team.admin.patch(f"/api/v1/cvms/{cvm_id}", json={"state": state})
    assert done.status_code in (200, 202), done.text
    deadline = time.monotonic() + 600  # an ACPI stop under TCG: up to the provider's 300 s
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
