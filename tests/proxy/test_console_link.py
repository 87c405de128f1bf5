"""The proxy's links to the Console: signed-bundle pull (ETag, rollback refusal, last good kept),
attachments, and traffic-log shipping that loses nothing while the Console is down or the proxy
restarts. The Console side is a small stand-in serving the documented endpoints."""

from __future__ import annotations

import hashlib
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization

from tests.proxy.conftest import Env
from tests.proxy.harness import (
    BOB_TOKEN,
    UMBRA,
    auth_header,
    connect_tunnel,
    read_response,
    start_proxy,
    status_of,
)
from umbra.policy.bundle import generate_key, payload_document, sign_bundle
from umbra.policy.loader import load_policy_dir

SECURITY_CVM = "sec-1"
CONSOLE_CREDENTIAL = "scvm-credential-0123456789abcdef"


class ConsoleStandIn(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _ConsoleHandler)
        self.bundle = b""
        self.attachments: dict[str, Any] = {
            "cvms": {"cvm-alice": {"owner": "alice", "team": "acme", "profiles": ["base"]}}
        }
        self.batches: list[list[dict[str, Any]]] = []
        self.up = True
        self.bundle_requests: list[str | None] = []
        self.bundle_times: list[float] = []
        self.unauthorized = 0
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def record_ids(self) -> list[str]:
        return [record["id"] for batch in self.batches for record in batch]


class _ConsoleHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ConsoleStandIn

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _conditional(self, body: bytes) -> None:
        etag = '"' + hashlib.sha256(body).hexdigest()[:16] + '"'
        if self.headers.get("if-none-match") == etag:
            self._send(304, b"", {"etag": etag})
        else:
            self._send(200, body, {"etag": etag})

    def _authorized(self) -> bool:
        # As the real Console: every Security CVM endpoint needs the credential from registration.
        if self.headers.get("authorization") == f"Bearer {CONSOLE_CREDENTIAL}":
            return True
        self.server.unauthorized += 1
        self._send(401, b"")
        return False

    def do_GET(self) -> None:
        if not self._authorized():
            return
        # The stand-in answers long polls (`?wait=`) at once; the puller then paces itself.
        path = self.path.split("?", 1)[0]
        if not self.server.up:
            self._send(503, b"down")
        elif path == f"/api/v1/security-cvms/{SECURITY_CVM}/bundle":
            self.server.bundle_requests.append(self.headers.get("if-none-match"))
            self.server.bundle_times.append(time.monotonic())
            self._conditional(self.server.bundle)
        elif path == f"/api/v1/security-cvms/{SECURITY_CVM}/attachments":
            self._conditional(json.dumps(self.server.attachments).encode())
        else:
            self._send(404, b"")

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        if not self._authorized():
            return
        if self.path != "/api/v1/traffic/batches" or not self.server.up:
            self._send(503, b"down")
            return
        self.server.batches.append(json.loads(body)["records"])
        self._send(202, b"{}")


def _profiles(env: Env, allow_ro: bool) -> str:
    port = env.origin.port
    ro = f"\n  - id: ro\n    allow: {{hosts: [ro.test], ports: [{port}]}}" if allow_ro else ""
    return f"""
apiVersion: umbra/v1
kind: Profile
name: base
egress:
  - id: other
    allow: {{hosts: [other.test], ports: [{port}]}}{ro}
"""


def _bundle(env: Env, tmp: Path, key: Any, serial: int, allow_ro: bool) -> bytes:
    directory = tmp / f"policy-{serial}-{allow_ro}-{time.monotonic_ns()}"
    directory.mkdir()
    (directory / "base.yaml").write_text(_profiles(env, allow_ro))
    policy = load_policy_dir(directory)
    compiled = [loaded.compiled for loaded in policy.profiles.values()]
    return sign_bundle(payload_document(compiled, serial, f"test-{serial}"), [key])


@pytest.fixture
def console() -> Iterator[ConsoleStandIn]:
    server = ConsoleStandIn()
    yield server
    server.shutdown()


def _status(env: Env, proxy_port_env: Any, host: str) -> int:
    sock, response = connect_tunnel(proxy_port_env, f"{host}:{env.origin.port}", sni=host)
    if status_of(response) != 200:
        return status_of(response)
    sock.sendall(f"GET /console-{host} HTTP/1.1\r\nHost: {host}:{env.origin.port}\r\n\r\n".encode())
    return status_of(read_response(sock))


def test_bundle_pull_rollback_and_shipping(
    env: Env, console: ConsoleStandIn, tmp_path: Path
) -> None:
    key = generate_key()
    key_path = tmp_path / "bundle-key.pub"
    key_path.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    console.bundle = _bundle(env, tmp_path, key, serial=5, allow_ro=False)
    workdir = tmp_path / "proxy"
    workdir.mkdir()
    credential = tmp_path / "console-credential"
    credential.write_text(CONSOLE_CREDENTIAL + "\n")
    args = [
        "--console-credential-file",
        str(credential),
        "--console",
        console.url,
        "--security-cvm-id",
        SECURITY_CVM,
        "--bundle-key",
        str(key_path),
        "--state-dir",
        str(workdir / "state"),
        "--identities",
        str(env.identities),
        "--secrets",
        str(env.secrets),
        "--upstream-ca",
        str(env.ca.cert_path),
        "--test-allow-upstream",
        "127.0.0.1/32",
        "--test-resolver",
        str(env.resolver),
    ]
    proxy = start_proxy(args, workdir)
    try:
        deadline = time.monotonic() + 5
        while _status(env, proxy, "other.test") != 200:
            assert time.monotonic() < deadline, "first bundle never took effect"
            time.sleep(0.1)
        assert _status(env, proxy, "ro.test") == 403
        time.sleep(0.6)
        assert console.bundle_requests[-1] is not None, "puller does not send If-None-Match"
        # bob is in the identities file but not attached at the Console: unknown to this proxy.
        bob = connect_tunnel(
            proxy,
            f"other.test:{env.origin.port}",
            sni=None,
            auth=auth_header("cvm-bob", BOB_TOKEN),
            tls=False,
        )
        assert status_of(bob[1]) == 407

        # A new bundle takes effect within one second of being published.
        console.bundle = _bundle(env, tmp_path, key, serial=6, allow_ro=True)
        published = time.monotonic()
        while _status(env, proxy, "ro.test") != 200:
            assert time.monotonic() - published < 1.0, "new policy took longer than 1 s"
            time.sleep(0.02)

        # Rollback to a lower serial, and a bundle signed by another key, are both refused.
        console.bundle = _bundle(env, tmp_path, key, serial=5, allow_ro=False)
        time.sleep(1.2)
        assert _status(env, proxy, "ro.test") == 200
        console.bundle = _bundle(env, tmp_path, generate_key(), serial=9, allow_ro=False)
        time.sleep(1.2)
        assert _status(env, proxy, "ro.test") == 200

        # The Console goes down: records are kept, not lost.
        console.up = False
        shipped_before = len(console.record_ids())
        for _ in range(3):
            _status(env, proxy, "evil.test")
        time.sleep(0.5)
        assert len(console.record_ids()) == shipped_before
    finally:
        proxy.stop()

    # Restart the proxy while the Console is still down; it keeps the last good bundle (serial 6).
    proxy = start_proxy(args, workdir)
    try:
        assert _status(env, proxy, "ro.test") == 200
        console.up = True
        deadline = time.monotonic() + 15
        spooled = {record["id"] for record in proxy.log.records()}
        while not spooled <= set(console.record_ids()):
            assert time.monotonic() < deadline, "spooled records were not all shipped"
            time.sleep(0.2)
            spooled = {record["id"] for record in proxy.log.records()}
        assert any(
            r.get("reason") == "no_matching_rule" and r.get("connect_host") == "evil.test"
            for batch in console.batches
            for r in batch
        )
        # Attachments decide who is known: detaching alice denies her.
        console.attachments = {"cvms": {}}
        deadline = time.monotonic() + 3
        while _status(env, proxy, "other.test") != 407:
            assert time.monotonic() < deadline, "detaching did not take effect"
            time.sleep(0.1)
    finally:
        proxy.stop()
    assert console.unauthorized == 0, "every Console call carried the Security CVM's credential"
    assert CONSOLE_CREDENTIAL not in proxy.output.read_text(errors="replace"), "never logged"


def test_console_mode_refuses_to_start_without_a_credential(tmp_path: Path) -> None:
    key_path = tmp_path / "bundle-key.pub"
    key_path.write_bytes(
        generate_key()
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    identities = tmp_path / "identities.yaml"
    identities.write_text("cvms: {}\n")
    result = subprocess.run(
        [str(UMBRA), "proxy", "serve", "--console", "http://127.0.0.1:9", "--security-cvm-id",
         SECURITY_CVM, "--bundle-key", str(key_path), "--identities", str(identities),
         "--traffic-log", str(tmp_path / "spool"), "--confdir", str(tmp_path / "ca")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--console needs --console-credential-file" in result.stderr


def test_unchanged_answers_are_paced_and_a_change_is_followed_at_once(
    env: Env, console: ConsoleStandIn, tmp_path: Path
) -> None:
    """The stand-in answers every long poll at once. Answers without a change are paced (0.5 s),
    so such a Console is not polled in a hot loop; an answer that installed a new bundle is
    followed by the next poll at once, so back-to-back publishes converge without waiting."""
    import asyncio

    import httpx

    from umbra.proxy.identity import StaticIdentities
    from umbra.proxy.puller import PolicyPuller
    from umbra.proxy.secrets import SecretStore
    from umbra.proxy.state import PolicyState

    key = generate_key()
    console.bundle = _bundle(env, tmp_path, key, serial=5, allow_ro=False)
    state = PolicyState(SecretStore.empty())

    async def run() -> tuple[float, int]:
        async with httpx.AsyncClient(
            headers={"Authorization": f"Bearer {CONSOLE_CREDENTIAL}"}
        ) as client:
            puller = PolicyPuller(
                console.url, SECURITY_CVM, [key.public_key()], state,
                StaticIdentities.from_file(env.identities), tmp_path / "state", client=client,
            )  # fmt: skip
            task = asyncio.create_task(puller.run())
            try:
                await asyncio.sleep(1.6)
                settled = len(console.bundle_times)
                console.bundle = _bundle(env, tmp_path, key, serial=6, allow_ro=True)
                installed_at = len(console.bundle_times)
                for _ in range(100):  # bounded: 5 s
                    if len(console.bundle_times) >= installed_at + 3:
                        break
                    await asyncio.sleep(0.05)
                times = console.bundle_times[installed_at:]
                return times[1] - times[0], settled
            finally:
                task.cancel()

    follow_up, settled = asyncio.run(run())
    assert state.source.bundle is not None and state.source.bundle.serial == 6
    # 1.6 s of unchanged answers: about four polls, not a hot loop.
    assert 2 <= settled <= 6, console.bundle_times
    # Polls *start* at least 0.5 s apart; the stand-in sees them arrive, each late by its own
    # latency, so two arrivals may be closer (one slow, the next fast). Over the run the spacing
    # holds up to one request's latency.
    unchanged = console.bundle_times[1:settled]
    span = unchanged[-1] - unchanged[0]
    assert span >= 0.5 * (len(unchanged) - 1) - 0.25, console.bundle_times
    assert follow_up < 0.3, "the poll after an installed bundle was paced"
