"""Shared test helpers: signed bundles from small profiles, a running Console on loopback."""

from __future__ import annotations

import base64
import logging
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from fastapi import FastAPI

from tests.console import enroll
from umbra.console.app import create_app
from umbra.console.config import Settings
from umbra.console.serve import listening_socket
from umbra.console.state import Console
from umbra.policy.bundle import payload_document, sign_bundle
from umbra.policy.compiled import compile_profile
from umbra.policy.model import Profile


def profile(name: str, *, hosts: Iterable[str] = (), inject_host: str | None = None) -> Any:
    document: dict[str, Any] = {"apiVersion": "umbra/v1", "kind": "Profile", "name": name}
    if hosts:
        document["egress"] = [{"allow": {"hosts": list(hosts)}}]
    if inject_host:
        document["inject"] = [
            {
                "header": "Authorization",
                "format": "Bearer {secret}",
                "secret": "team/bot",
                "hosts": [inject_host],
            }
        ]
    compiled, _lines = compile_profile(Profile.model_validate(document))
    return compiled


def make_bundle(key: Ed25519PrivateKey, serial: int, profiles: list[Any]) -> bytes:
    return sign_bundle(payload_document(profiles, serial, f"test@{serial}"), [key])


def standard_bundle(key: Ed25519PrivateKey, serial: int) -> bytes:
    """github + web compose; clash-a and clash-b inject the same header for the same host."""
    return make_bundle(
        key,
        serial,
        [
            profile("github", hosts=["github.com"]),
            profile("web", hosts=["example.com"]),
            profile("clash-a", inject_host="api.example.com"),
            profile("clash-b", inject_host="api.example.com"),
        ],
    )


class CaptureHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.lines: list[str] = []
        self._lock2 = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
            if record.exc_info:
                text += logging.Formatter().formatException(record.exc_info)
        except Exception:  # a log record that cannot format is itself a finding
            text = repr(record.__dict__)
        with self._lock2:
            self.lines.append(text)

    def text(self) -> str:
        with self._lock2:
            return "\n".join(self.lines)


@dataclass
class Server:
    backend: str
    url: str
    app: FastAPI
    settings: Settings
    sqlite_path: Path | None
    bundle_key: Ed25519PrivateKey
    _server: uvicorn.Server
    _thread: threading.Thread
    responses: list[bytes] = field(default_factory=list)

    @property
    def console(self) -> Console:
        console: Console = self.app.state.console
        return console

    def client(self, token: str | None = None, **kwargs: Any) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}

        def record(response: httpx.Response) -> None:
            response.read()
            self.responses.append(bytes(response.content))
            self.responses.append(
                "\n".join(f"{k}: {v}" for k, v in response.headers.items()).encode()
            )

        return httpx.Client(
            base_url=self.url,
            headers=headers,
            timeout=30,
            event_hooks={"response": [record]},
            **kwargs,
        )

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


def start_server(
    backend: str,
    database_url: str,
    sqlite_path: Path | None,
    issuer_url: str,
    bundle_key: Ed25519PrivateKey,
    tmp: Path,
    *,
    stack_factory: Any = None,
    listen: str = "127.0.0.1",
    tls: tuple[Path, Path, str] | None = None,
    port: int = 0,
    **overrides: Any,
) -> Server:
    """`tls`: (certificate, key, the host name or address its URL names), e.g. for a Console that
    containers reach on the Docker bridge's gateway; clients then need to trust its CA. `port`:
    0 picks one; a fixed one when a setting must name it before the Console starts (the
    emulated cloud's forwards)."""
    from cryptography.hazmat.primitives import serialization

    from umbra.console import db

    pub = tmp / "bundle.pub"
    pub.write_bytes(
        bundle_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    db.upgrade(database_url)
    settings = Settings(
        database_url=database_url,
        oidc_issuer=issuer_url,
        oidc_allow_insecure_http=True,
        oidc_jwks_min_refresh_seconds=0,
        bundle_public_keys=[pub],
        kek={"k1": base64.b64encode(os.urandom(32)).decode()},
        long_poll_db_interval_seconds=0.25,
        **overrides,
    )
    app = create_app(settings, stack_factory=stack_factory)
    enroll.install(app.state.console)
    sock = listening_socket(listen, port)
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        log_config=None,
        access_log=True,
        lifespan="on",
        ssl_certfile=str(tls[0]) if tls is not None else None,
        ssl_keyfile=str(tls[1]) if tls is not None else None,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("console did not start")
        time.sleep(0.02)
    return Server(
        backend=backend,
        url=f"https://{tls[2]}:{port}" if tls is not None else f"http://127.0.0.1:{port}",
        app=app,
        settings=settings,
        sqlite_path=sqlite_path,
        bundle_key=bundle_key,
        _server=server,
        _thread=thread,
    )


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def traffic_record(team: str, **fields: Any) -> dict[str, Any]:
    record: dict[str, Any] = {
        "id": str(uuid.uuid4()),
        "time": datetime.now(UTC).isoformat(),
        "team": team,
        "decision": "allow",
        "method": "GET",
        "host": "github.com",
        "connect_host": "github.com",
        "sni": "github.com",
        "path": "/",
        "query_keys": ["q"],
        "status": 200,
        "rule_id": "github:egress-0",
        "reason": "rule_allow",
    }
    record.update(fields)
    return record


@dataclass
class Team:
    """A fresh team on a running Console: an admin, a developer, a Security CVM and its token."""

    server: Server
    name: str
    admin: httpx.Client
    dev: httpx.Client
    admin_subject: str
    dev_subject: str
    scvm_id: str
    scvm: httpx.Client

    def upload(self, serial: int, bundle: bytes | None = None) -> httpx.Response:
        raw = bundle if bundle is not None else standard_bundle(self.server.bundle_key, serial)
        return self.admin.post(f"/api/v1/teams/{self.name}/bundles", content=raw)

    def dev_cvm(self, name: str | None = None, *, owner: httpx.Client | None = None) -> str:
        client = owner or self.dev
        response = client.post(
            f"/api/v1/teams/{self.name}/cvms",
            json={"name": name or unique("d"), "security_cvm_id": self.scvm_id},
        )
        assert response.status_code == 201, response.text
        return str(response.json()["id"])

    def close(self) -> None:
        for client in (self.admin, self.dev, self.scvm):
            client.close()


def new_team(server: Server, issuer: Any, name: str | None = None) -> Team:
    name = name or unique("team")
    admin_subject, dev_subject = unique("admin"), unique("dev")
    admin = server.client(issuer.token(admin_subject, [f"{name}:admin"]))
    dev = server.client(issuer.token(dev_subject, [f"{name}:developer"]))
    response = admin.post(f"/api/v1/teams/{name}/cvms", json={"name": "sec", "kind": "security"})
    assert response.status_code == 201, response.text
    assert "credential" not in response.json()  # only ever issued after attestation
    with tempfile.TemporaryDirectory(prefix="u11-enroll-") as tmp:
        credential = enroll.security_credential(server.url, admin, response.json()["id"], Path(tmp))
    scvm = server.client(credential)
    return Team(server, name, admin, dev, admin_subject, dev_subject, response.json()["id"], scvm)
