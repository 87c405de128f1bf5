"""The vendor stand-ins on their own (cli/vendor_origin.py): the subscription's Bearer accepted
and an API key refused beside it; the refresh chain rotating on every use and refusing a spent
token; ChatGPT's backend only with a live minted token. And the sandbox's placeholder Codex login
(contracts/agent_logins.py): identity claims only, no byte of the real tokens."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import zstandard
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from tests.proxy.harness import TestCA as OriginCA
from umbra.cli import ws_frames
from umbra.cli.llm_origin import REPLY
from umbra.cli.vendor_origin import CODEX_CLIENT_ID, VendorServer, VendorState, serve_vendor
from umbra.cli.ws_frames import Opcode
from umbra.contracts.agent_logins import CODEX_PLACEHOLDER, codex_placeholder_auth

TOKEN = "sk-ant-oat01-vendor-test-" + "x" * 20


@pytest.fixture(scope="module")
def vendor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VendorServer, Path]]:
    workdir = tmp_path_factory.mktemp("vendor")
    ca = OriginCA(workdir)
    cert, key = ca.issue(["api.anthropic.com", "chatgpt.com", "auth.openai.com"])
    state = VendorState(hashlib.sha256(TOKEN.encode()).hexdigest(), access_ttl=2)
    server = serve_vendor(state, str(cert), str(key), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server, ca.cert_path
    server.shutdown()


def _client(vendor: tuple[VendorServer, Path], host: str) -> httpx.Client:
    server, ca = vendor
    return httpx.Client(
        base_url=f"https://127.0.0.1:{server.port}",
        verify=ssl.create_default_context(cafile=ca),
        headers={"host": host},
    )


def test_anthropic_takes_the_subscription_bearer_and_refuses_an_api_key_beside_it(
    vendor: tuple[VendorServer, Path],
) -> None:
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    with _client(vendor, "api.anthropic.com") as client:
        ok = client.post("/v1/messages", json=body, headers={"authorization": f"Bearer {TOKEN}"})
        assert ok.status_code == 200 and REPLY in ok.text
        both = client.post(
            "/v1/messages", json=body,
            headers={"authorization": f"Bearer {TOKEN}", "x-api-key": "sk-ant-api-key"},
        )  # fmt: skip
        assert both.status_code == 401 and TOKEN not in both.text
        wrong = client.post("/v1/messages", json=body, headers={"authorization": "Bearer nope"})
        assert wrong.status_code == 401
    counts = vendor[0].vendor.snapshot()["counts"]
    assert counts["anthropic_x_api_key"] == 1 and counts["api.anthropic.com_refused"] == 1


def test_the_refresh_chain_rotates_and_a_spent_token_is_refused(
    vendor: tuple[VendorServer, Path],
) -> None:
    login = vendor[0].vendor.login()
    first = login["tokens"]["refresh_token"]
    with _client(vendor, "auth.openai.com") as auth, _client(vendor, "chatgpt.com") as chatgpt:
        form = {"grant_type": "refresh_token", "client_id": CODEX_CLIENT_ID, "refresh_token": first}
        rotated = auth.post("/oauth/token", data=form).json()
        assert rotated["refresh_token"] != first and rotated["expires_in"] == 2
        assert auth.post("/oauth/token", data=form).json()["error"] == "invalid_grant"
        bearer = {"authorization": f"Bearer {rotated['access_token']}"}
        check = chatgpt.get("/backend-api/wham/accounts/check", headers=bearer)
        assert check.status_code == 200 and check.json()["default_account_id"]
        # Codex 0.171 refuses a workspace without one of these (docs/specs/embedded.md).
        (account,) = check.json()["accounts"]
        assert account["account_routing_override"] in ("NO_CONSTRAINT", "us", "us_cr")
        assert account["workspace_backend_origin"] == "https://chatgpt.com"
        turn = chatgpt.post("/backend-api/codex/responses", json={"input": "hi"}, headers=bearer)
        assert turn.status_code == 200 and REPLY in turn.text
        # Codex's built-in provider sends its turns zstd-compressed.
        packed = zstandard.ZstdCompressor().compress(json.dumps({"input": "hi"}).encode())
        zstd = {**bearer, "content-encoding": "zstd", "content-type": "application/json"}
        turn = chatgpt.post("/backend-api/codex/responses", content=packed, headers=zstd)
        assert turn.status_code == 200 and REPLY in turn.text
        garbled = chatgpt.post("/backend-api/codex/responses", content=b"{}", headers=zstd)
        assert garbled.status_code == 400
        # Its first choice, the Responses WebSocket: refused without a live token, else each
        # `response.create` answered by the streamed events, one message each.
        assert _websocket_turn(vendor, {}) == ["HTTP 401"]
        events = _websocket_turn(vendor, bearer)
        assert events[0] == "response.created" and events[-1] == "response.completed", events
        assert "response.output_text.delta" in events
        stale = {"authorization": f"Bearer {login['tokens']['access_token']}"}
        time.sleep(2.2)  # both expired now
        assert chatgpt.get("/backend-api/wham/settings/user", headers=stale).status_code == 401
    snapshot = vendor[0].vendor.snapshot()
    assert snapshot["counts"]["refresh_reused"] == 1 and snapshot["counts"]["refresh_ok"] == 1
    assert (
        snapshot["refresh_sha256"] == hashlib.sha256(rotated["refresh_token"].encode()).hexdigest()
    )


def _websocket_turn(vendor: tuple[VendorServer, Path], headers: dict[str, str]) -> list[str]:
    """One turn over `wss://chatgpt.com/backend-api/codex/responses` (the `websockets` client):
    the events' types, or the handshake's refusal."""
    server, ca = vendor
    url = f"wss://chatgpt.com:{server.port}/backend-api/codex/responses"
    types: list[str] = []
    try:
        with connect(url, sock=socket.create_connection(("127.0.0.1", server.port), timeout=10),
                     ssl=ssl.create_default_context(cafile=ca), additional_headers=headers,
                     compression=None, open_timeout=10) as client:  # fmt: skip
            client.send(json.dumps({"type": "response.create", "input": "hi", "stream": True}))
            while not types or types[-1] != "response.completed":
                types.append(json.loads(client.recv(timeout=10))["type"])
    except InvalidStatus as exc:
        return [f"HTTP {exc.response.status_code}"]
    return types


def _claims(jwt: str) -> dict[str, object]:
    payload = jwt.split(".")[1]
    result: dict[str, object] = json.loads(base64.urlsafe_b64decode(payload + "==="))
    return result


def test_the_placeholder_codex_login_holds_identity_claims_only() -> None:
    state = VendorState("0" * 64)
    login = state.login()
    tokens = login["tokens"]
    identity = _claims(tokens["id_token"])
    text = codex_placeholder_auth(identity, tokens["account_id"], 1_800_000_000)
    for secret in (tokens["access_token"], tokens["refresh_token"], tokens["id_token"]):
        assert secret not in text
    doc = json.loads(text)
    assert doc["tokens"]["refresh_token"] == CODEX_PLACEHOLDER
    assert doc["last_refresh"] == "2027-01-15T08:00:00Z"
    access = _claims(doc["tokens"]["access_token"])
    assert access["https://api.openai.com/auth"] == identity["https://api.openai.com/auth"]
    assert access["exp"] == 4_102_444_800 and doc["tokens"]["account_id"] == tokens["account_id"]
    assert doc["tokens"]["access_token"].endswith(
        base64.urlsafe_b64encode(CODEX_PLACEHOLDER.encode()).rstrip(b"=").decode()
    )


def _masked(opcode: int, payload: bytes, fin: bool = True) -> bytes:
    mask = b"\x01\x02\x03\x04"
    body = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return bytes([(0x80 if fin else 0) | opcode, 0x80 | len(payload)]) + mask + body


def test_websocket_frames_fragments_control_frames_and_refusals() -> None:
    stream = io.BytesIO(
        _masked(0x1, b'{"type":', fin=False) + _masked(0x0, b'"x"}') + _masked(0x9, b"hb")
    )
    assert ws_frames.read_message(stream) == ws_frames.Message(Opcode.TEXT, b'{"type":"x"}')
    assert ws_frames.read_message(stream) == ws_frames.Message(Opcode.PING, b"hb")
    with pytest.raises(EOFError):
        ws_frames.read_message(stream)
    with pytest.raises(ws_frames.FrameError, match="masked"):
        ws_frames.read_message(io.BytesIO(ws_frames.frame(Opcode.TEXT, b"unmasked")))
    with pytest.raises(ws_frames.FrameError, match="continuation"):
        ws_frames.read_message(io.BytesIO(_masked(0x0, b"orphan")))
    assert ws_frames.frame(Opcode.TEXT, b"x" * 70000)[:2] == b"\x81\x7f"  # 64-bit length
    # RFC 6455's own example.
    assert ws_frames.accept_key("dGhlIHNhbXBsZSBub25jZQ==") == "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
