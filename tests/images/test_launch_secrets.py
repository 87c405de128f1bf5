"""The Console VM's secret reads: GCP's against a loopback stand-in for the metadata server's
token endpoint and Secret Manager's access call; retries while a fresh grant propagates, then a
refusal naming the reference and the attempts, never a value or a token."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from umbra.images.launch_secrets import GcpSecretManager, Retrying, SecretReadError

REF = "projects/umbra-control/secrets/umbra-console-db-password/versions/1"
VALUE = "the-db-password-9f1c"
TOKEN = "ya29.metadata-token-b7e2"


@dataclass
class Google:
    url: str = ""
    denials: int = 0  # 403 this many times first (IAM propagating)
    seen_auth: list[str] = field(default_factory=list)


@pytest.fixture
def google() -> Iterator[Google]:
    state = Google()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            return None

        def _send(self, code: int, doc: object) -> None:
            data = json.dumps(doc).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/computeMetadata/v1/instance/service-accounts/default/token":
                if self.headers.get("Metadata-Flavor") != "Google":
                    return self._send(403, {})
                return self._send(200, {"access_token": TOKEN, "expires_in": 3599})
            if self.path == f"/v1/{REF}:access":
                state.seen_auth.append(self.headers.get("Authorization", ""))
                if state.denials > 0:
                    state.denials -= 1
                    return self._send(403, {"error": {"message": "Permission denied"}})
                data = base64.b64encode(VALUE.encode()).decode()
                return self._send(200, {"name": REF, "payload": {"data": data}})
            return self._send(404, {})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()


def test_gcp_reads_the_version_with_the_vm_service_account_token(google: Google) -> None:
    reader = GcpSecretManager(metadata=google.url, api=google.url)
    assert reader.read(REF) == VALUE
    assert google.seen_auth == [f"Bearer {TOKEN}"]


def test_a_grant_still_propagating_is_retried_then_read(google: Google) -> None:
    google.denials = 2
    slept: list[float] = []
    lines: list[str] = []
    reader = Retrying(
        GcpSecretManager(metadata=google.url, api=google.url),
        delays=(1.0, 2.0, 3.0),
        sleep=slept.append,
        say=lines.append,
    )
    assert reader.read(REF) == VALUE
    assert slept == [1.0, 2.0]
    assert all("HTTP 403" in line and VALUE not in line and TOKEN not in line for line in lines)


def test_a_grant_that_never_comes_is_refused_naming_the_attempts(google: Google) -> None:
    google.denials = 99
    reader = Retrying(
        GcpSecretManager(metadata=google.url, api=google.url),
        delays=(1.0, 1.0),
        sleep=lambda _s: None,
    )
    with pytest.raises(SecretReadError) as err:
        reader.read(REF)
    assert str(err.value) == f"{REF}: HTTP 403 (after 3 attempts)"
    assert TOKEN not in str(err.value)


def test_a_reference_for_another_store_is_not_retried() -> None:
    calls: list[float] = []
    reader = Retrying(GcpSecretManager(), delays=(1.0,), sleep=calls.append)
    with pytest.raises(SecretReadError, match="not a Secret Manager version"):
        reader.read("https://umbra-kv.vault.azure.net/secrets/db-password")
    assert calls == []
