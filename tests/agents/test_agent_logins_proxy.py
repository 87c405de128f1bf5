"""The agents' own logins through the real proxy, on this host (no Console, no sandbox: the light
twin of tests/up/test_agent_logins.py): the shipped `claude-subscription` and `codex-chatgpt`
profiles, the vendor stand-ins answering as api.anthropic.com, chatgpt.com and auth.openai.com
(cli/vendor_origin.py, on 127.0.0.26:443), the real `claude -p` with only
`CLAUDE_CODE_OAUTH_TOKEN=<placeholder>`, the real `codex exec` with only the placeholder
`~/.codex/auth.json`. The proxy injects the subscription token and mints ChatGPT access tokens
from a refresh token the stand-in rotates on every use."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.agents.test_agents_e2e import agent_bin
from tests.proxy.harness import ALICE_TOKEN, ProxyProcess, start_proxy
from tests.proxy.harness import TestCA as OriginCA
from umbra.cli.llm_origin import REPLY
from umbra.cli.up_agents import CLAUDE_QUIET
from umbra.cli.vendor_origin import (
    ACCOUNT_ID,
    CODEX_CLIENT_ID,
    VendorServer,
    VendorState,
    serve_vendor,
)
from umbra.contracts.agent_logins import codex_placeholder_auth
from umbra.proxy.identity import hash_credential

REPO = Path(__file__).resolve().parents[2]
ADDR = "127.0.0.26"  # not tests/up's 127.0.0.25: both may run on one machine
HOSTS = ["api.anthropic.com", "auth.openai.com", "chatgpt.com"]
TOKEN = "sk-ant-oat01-UMBRALIGHT-" + "s3cr3tSubscr1pt10n" * 3
PROFILES = ["claude-subscription", "codex-chatgpt"]
# `codex exec` as a developer types it: the built-in `openai` provider, no configuration.
CODEX = ["codex", "exec", "--skip-git-repo-check", "--ephemeral", "--color", "never", "say hi"]
ACCOUNT_READ = (Path(__file__).parent / "codex_account_read.py").read_text()
CHATGPT_PROVIDER = (
    '{name="ChatGPT", base_url="https://chatgpt.com/backend-api/codex", wire_api="responses", '
    "requires_openai_auth=true, request_max_retries=0, stream_max_retries=0}"
)


@dataclass
class Env:
    workdir: Path
    proxy: ProxyProcess
    vendor: VendorServer
    bin_dir: Path
    refresh0: str


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    if os.geteuid() != 0:
        pytest.skip("the stand-ins listen on port 443 (root)")
    if shutil.which("npm") is None:
        pytest.fail("npm is needed to install the pinned agents (scripts/system-deps)")
    bin_dir = agent_bin()
    workdir = tmp_path_factory.mktemp("logins")
    ca = OriginCA(workdir)
    cert, key = ca.issue(HOSTS)
    state = VendorState(hashlib.sha256(TOKEN.encode()).hexdigest(), access_ttl=8)
    vendor = serve_vendor(state, str(cert), str(key), ADDR, 443)
    threading.Thread(target=vendor.serve_forever, daemon=True).start()
    login = state.login()
    policies = workdir / "policies"
    policies.mkdir()
    for name in PROFILES:
        shutil.copy(REPO / "policies" / "profiles" / f"{name}.yaml", policies)
    (workdir / "resolver.json").write_text(json.dumps({h: [ADDR] for h in HOSTS}))
    identities = {"cvms": [{"cvm_id": "cvm-alice", "owner": "alice", "team": "acme",
                            "profiles": PROFILES,
                            "credential_sha256": hash_credential(ALICE_TOKEN)}]}  # fmt: skip
    (workdir / "identities.json").write_text(json.dumps(identities))
    document = {"kind": "oauth2-refresh", "token_url": "https://auth.openai.com/oauth/token",
                "client_id": CODEX_CLIENT_ID,
                "refresh_token": login["tokens"]["refresh_token"]}  # fmt: skip
    secrets = {"personal": {"alice": {"claude-oauth-token": TOKEN, "codex-chatgpt": document}}}
    (workdir / "secrets.json").write_text(json.dumps(secrets))
    (workdir / "secrets.json").chmod(0o600)
    proxy = start_proxy(
        [
            *("--policy-dir", str(policies), "--identities", str(workdir / "identities.json")),
            *("--secrets", str(workdir / "secrets.json"), "--upstream-ca", str(ca.cert_path)),
            *("--test-allow-upstream", f"{ADDR}/32"),
            *("--test-resolver", str(workdir / "resolver.json")),
        ],
        workdir,
    )  # fmt: skip
    home = workdir / "home"
    (home / ".codex").mkdir(parents=True)
    identity_claims = json.loads(
        __import__("base64").urlsafe_b64decode(login["tokens"]["id_token"].split(".")[1] + "==")
    )
    (home / ".codex" / "auth.json").write_text(
        codex_placeholder_auth(identity_claims, login["tokens"]["account_id"], time.time())
    )
    yield Env(workdir, proxy, vendor, bin_dir, login["tokens"]["refresh_token"])
    output = proxy.stop()
    vendor.shutdown()
    spool = b"".join(p.read_bytes() for p in (workdir / "spool").rglob("*.jsonl"))
    for secret in (TOKEN, login["tokens"]["refresh_token"], login["tokens"]["access_token"]):
        assert secret not in output and secret.encode() not in spool


def _run(
    env: Env, argv: list[str], extra: dict[str, str], stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """As a sandbox login runs an agent: the proxy and its CA, a clean HOME, nothing else."""
    url, ca = env.proxy.url(), str(env.proxy.ca)
    login = {
        "PATH": f"{env.bin_dir}:/usr/local/bin:/usr/bin:/bin", "HOME": str(env.workdir / "home"),
        "LANG": "C.UTF-8", "TERM": "dumb", "HTTPS_PROXY": url, "HTTP_PROXY": url,
        "https_proxy": url, "http_proxy": url, "NODE_EXTRA_CA_CERTS": ca, "SSL_CERT_FILE": ca,
        "CODEX_CA_CERTIFICATE": ca, "NO_COLOR": "1",
    }  # fmt: skip
    work = env.workdir / "home" / "work"
    work.mkdir(exist_ok=True)
    return subprocess.run(
        argv, env=login | extra, cwd=work, capture_output=True, text=True, timeout=120,
        input=stdin, stdin=None if stdin is not None else subprocess.DEVNULL, check=False,
    )  # fmt: skip


def test_claude_subscription_token_injected_as_a_bearer(env: Env) -> None:
    placeholder = {"CLAUDE_CODE_OAUTH_TOKEN": "umbra-placeholder:personal/claude-oauth-token"}
    done = _run(env, ["claude", "-p", "say hi", "--output-format", "text"],
                CLAUDE_QUIET | placeholder)  # fmt: skip
    assert done.returncode == 0 and REPLY in done.stdout, done.stdout + done.stderr
    counts = env.vendor.vendor.snapshot()["counts"]
    assert counts.get("api.anthropic.com_ok", 0) >= 1, counts
    assert not counts.get("anthropic_x_api_key") and not counts.get("api.anthropic.com_refused")
    assert TOKEN not in done.stdout + done.stderr


def test_codex_chatgpt_login_minted_and_rotated(env: Env) -> None:
    """Codex as a developer runs it: its built-in `openai` provider, no config, only the
    placeholder `~/.codex/auth.json`."""
    seconds = []
    for index in range(3):
        if index:
            time.sleep(9)  # past the 8 s access token: the next run starts with a refresh
        started = time.monotonic()
        # As in `umbra up`, an API-key profile may put OPENAI_API_KEY beside the ChatGPT login.
        done = _run(env, CODEX, {"OPENAI_API_KEY": "umbra-placeholder:personal/openai-api-key"})
        seconds.append(round(time.monotonic() - started, 2))
        assert done.returncode == 0 and REPLY in done.stdout, done.stdout + done.stderr[-3000:]
        assert env.refresh0 not in done.stdout + done.stderr
    print(f"codex exec (built-in provider) with minted ChatGPT tokens through the proxy: "
          f"{seconds} s")  # fmt: skip
    counts = env.vendor.vendor.snapshot()["counts"]
    assert counts.get("codex_turn", 0) >= 3 and not counts.get("chatgpt.com_refused"), counts
    # Each run's turn went over the Responses WebSocket, the minted token in its handshake.
    assert counts.get("codex_websocket", 0) >= 3, counts
    assert counts.get("codex_turn_websocket", 0) >= 3, counts
    assert counts.get("accounts_check", 0) >= 3, counts  # the routing discovery before a turn
    assert counts.get("refresh_ok", 0) >= 3, counts  # one chain, rotated on every run
    assert not counts.get("refresh_reused") and not counts.get("refresh_refused"), counts
    auth = (env.workdir / "home" / ".codex" / "auth.json").read_text()
    assert "umbra-placeholder:personal/codex-chatgpt" in auth and env.refresh0 not in auth


def test_codex_workspace_routing_discovery_through_the_proxy(env: Env) -> None:
    """What Codex's interactive UI asks first with a ChatGPT login (`account/read`, which runs
    the workspace routing discovery, GET /backend-api/wham/accounts/check) answers the
    stand-in's workspace, reached with a minted token."""
    before = env.vendor.vendor.snapshot()["counts"].get("accounts_check", 0)
    done = _run(env, ["python3", "-"], {}, stdin=ACCOUNT_READ)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    answer = json.loads(done.stdout)["result"]
    assert answer["account"]["type"] == "chatgpt", answer
    assert answer["workspaceRouting"] == {
        "chatgptAccountId": ACCOUNT_ID, "backendOrigin": "https://chatgpt.com",
        "accountRoutingOverride": "NO_CONSTRAINT",
    }, answer  # fmt: skip
    assert env.vendor.vendor.snapshot()["counts"]["accounts_check"] == before + 1
    assert env.refresh0 not in done.stdout + done.stderr


def test_codex_provider_entry_for_the_chatgpt_backend(env: Env) -> None:
    """The same login through a provider entry naming the ChatGPT backend
    (`requires_openai_auth`): same tokens, same headers, the turn over HTTPS."""
    entry = ["-c", "model_provider=chatgpt", "-c", f"model_providers.chatgpt={CHATGPT_PROVIDER}"]
    before = env.vendor.vendor.snapshot()["counts"]
    done = _run(env, [*CODEX[:-1], *entry, CODEX[-1]], {})
    assert done.returncode == 0 and REPLY in done.stdout, done.stdout + done.stderr[-3000:]
    after = env.vendor.vendor.snapshot()["counts"]
    assert after["codex_turn"] > before["codex_turn"], after
    assert after["codex_turn_websocket"] == before["codex_turn_websocket"], after
    assert env.refresh0 not in done.stdout + done.stderr
