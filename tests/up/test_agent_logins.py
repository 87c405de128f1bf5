"""`umbra connect claude|codex` end to end through the real path: `umbra up` (with the vendor
stand-ins: the stand-in model API answers as api.anthropic.com, chatgpt.com and auth.openai.com),
`umbra connect`, then the real `claude -p` and `codex exec` from the npm packages in the sandbox
through `umbra ssh`, the forwarder and the Security CVM, which injects the subscription token and
mints ChatGPT access tokens from a refresh token the stand-in rotates on every use.

Heavy (a whole `umbra up`): run under `flock /tmp/umbra-heavy.lock`.
"""

from __future__ import annotations

import base64
import json
import os
import shlex
import ssl
import statistics
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.session.harness import stop_agents
from tests.up.test_up import UMBRA, Up, _free_base, _require_root
from umbra.cli import up_stack
from umbra.cli.llm_origin import REPLY
from umbra.cli.up_agents import CLAUDE_QUIET, Endpoints, agent_commands
from umbra.contracts.agent_logins import codex_placeholder_auth
from umbra.sandbox import image, local_cvm

CLAUDE_PLACEHOLDER = "umbra-placeholder:personal/claude-oauth-token"
QUIET = " ".join(f"{k}={v}" for k, v in CLAUDE_QUIET.items())
# `codex` as a developer runs it after `umbra connect codex`: the built-in `openai` provider, no
# configuration, only the placeholder ~/.codex/auth.json.
CODEX = "codex exec --skip-git-repo-check --ephemeral --color never 'say hi' < /dev/null"
# What Codex's interactive UI asks first (`account/read`: the workspace routing discovery).
ACCOUNT_READ = (Path(__file__).parents[1] / "agents" / "codex_account_read.py").read_text()


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    _require_root()
    image.ensure_image()
    tmp = tmp_path_factory.mktemp("logins")
    prefix = f"ual{os.getpid() % 100000}"
    (tmp / "home").mkdir()
    (tmp / "t").mkdir()
    env = {
        **os.environ,
        "HOME": str(tmp / "home"),
        "TMPDIR": str(tmp / "t"),
        "XDG_CONFIG_HOME": str(tmp / "config"),
        "UMBRA_UP_NAME_PREFIX": prefix,
        up_stack.VENDOR_ENV: "1",
        "NO_COLOR": "1",
        "COLUMNS": "200",
    }
    for opt_in in ("UMBRA_STATE_DIR", "UMBRA_SIMULATED_PKI", "UMBRA_SSH_IDENTITY"):
        env.pop(opt_in, None)
    handle = Up(tmp / "state", _free_base(), prefix, env)
    try:
        started = handle.run("up", "--json")
        assert started.returncode == 0, started.stdout + started.stderr + handle.logs()
        yield handle
    finally:
        stop_agents(tmp / "t")
        handle.run("down")
        for plan in local_cvm.all_plans(handle.state / "cvms"):
            local_cvm.shut_down(plan)


def _vendor(up: Up, method: str, path: str) -> dict[str, Any]:
    """The stand-in's own test routes, dialled directly (no profile allows /_umbra/)."""
    context = ssl.create_default_context(cafile=str(up.state / "demo-origin" / "ca.pem"))
    context.check_hostname = False
    with httpx.Client(verify=context, timeout=20) as client:
        answer = client.request(
            method, f"https://{up_stack.names.VENDOR_ADDR}:{up_stack.names.VENDOR_PORT}{path}"
        )
    answer.raise_for_status()
    result: dict[str, Any] = answer.json()
    return result


def _ssh(
    up: Up, command: str, timeout: float = 180, stdin: str = ""
) -> subprocess.CompletedProcess[str]:
    """`umbra ssh -- COMMAND` as the developer runs it (the attested path into the sandbox)."""
    return subprocess.run(
        [str(UMBRA), "ssh", "--no-reuse", "--", command],
        capture_output=True, text=True, env=up.env, timeout=timeout, input=stdin,
    )  # fmt: skip


def _session_env(up: Up, name: str) -> str:
    done = _ssh(up, f"echo ${{{name}:-unset}}")
    assert done.returncode == 0, done.stderr
    return str(done.stdout.strip())


def _wait_env(up: Up, name: str, want: str, within: float = 30) -> None:
    end = time.monotonic() + within
    while (got := _session_env(up, name)) != want:
        assert time.monotonic() < end, f"{name} is {got!r}, not {want!r}"
        time.sleep(0.5)


def _api_key_command(up: Up, agent: str) -> str:
    """`up --check`'s command for `agent` (the stand-in at llm.demo.test, a static API key
    injected): the baseline the subscription and ChatGPT paths are timed against."""
    base = f"https://{up_stack.LLM_HOST}:{up.base + up_stack.PORTS['llm']}"
    for command in agent_commands(Endpoints(base, base + "/v1")):
        if command.name.startswith(agent):
            env = [f"{k}={v}" for k, v in command.env.items()]
            return shlex.join(["env", *env, *command.argv]) + " < /dev/null"
    raise AssertionError(agent)


def _timed(up: Up, command: str) -> float:
    started = time.monotonic()
    done = _ssh(up, command)
    assert done.returncode == 0 and REPLY in done.stdout, done.stdout[-800:] + done.stderr[-2000:]
    return time.monotonic() - started


def _nowhere(up: Up, secret: bytes, outputs: list[str], skip: set[Path]) -> None:
    """The secret's bytes in no output, no sandbox environment or process, and no file of the
    state directory but the ones that hold it on purpose (`skip`): the Console's database, every
    component's log, the traffic spool, the sandbox's own files (its overlay's upper directory)."""
    for text in outputs:
        assert secret.decode() not in text
    seen = _ssh(up, "env; ps -eww -o args; cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n'")
    assert seen.returncode == 0, seen.stderr
    assert secret.decode() not in seen.stdout
    checked = 0
    for path in up.state.rglob("*"):
        try:
            if path in skip or not path.is_file() or path.is_symlink():
                continue
            if path.stat().st_size >= 64 << 20:
                continue
            data = path.read_bytes()
        except OSError:  # a file that came and went (a pid file, a socket's lock)
            continue
        checked += 1
        assert secret not in data, path
    assert checked > 50, checked


def test_claude_subscription_through_connect_and_ssh(up: Up) -> None:
    cvm = up.stack().state["dev_cvm_id"]
    static = [_timed(up, _api_key_command(up, "claude")) for _ in range(3)]
    token_file = up.state / "keys" / "claude-oauth-token"
    token = token_file.read_bytes().strip()
    connected = up.client("connect", "claude", "--token-file", str(token_file), "--json")
    assert connected.returncode == 0, connected.stderr
    result = json.loads(connected.stdout)
    assert result["cvms"] == [cvm] and result["shadowed_by"] == {cvm: ["anthropic-standin"]}
    assert f"umbra profile detach {cvm} anthropic-standin" in connected.stderr
    # umbra up's API-key stand-in profile would shadow the subscription (Claude Code prefers an
    # API key): detached, as the spec says.
    detached = up.client("profile", "detach", cvm, "anthropic-standin")
    assert detached.returncode == 0, detached.stderr
    _wait_env(up, "CLAUDE_CODE_OAUTH_TOKEN", CLAUDE_PLACEHOLDER)
    _wait_env(up, "ANTHROPIC_API_KEY", "unset")
    before = _vendor(up, "GET", "/_umbra/state")["counts"]
    started = time.monotonic()
    # No ANTHROPIC_BASE_URL: Claude Code calls api.anthropic.com itself.
    done = _ssh(up, f"env {QUIET} claude -p 'say hi' --output-format text")
    seconds = time.monotonic() - started
    print(f"claude -p with the subscription through umbra ssh: {seconds:.1f} s")
    assert done.returncode == 0 and REPLY in done.stdout, done.stdout + done.stderr + up.logs()
    after = _vendor(up, "GET", "/_umbra/state")["counts"]
    assert after.get("api.anthropic.com_ok", 0) > before.get("api.anthropic.com_ok", 0), after
    assert not after.get("anthropic_x_api_key") and not after.get("api.anthropic.com_refused")
    subscription = [_timed(up, f"env {QUIET} claude -p 'say hi'") for _ in range(3)]
    print(f"claude -p through umbra ssh: API key (static, x-api-key) median "
          f"{statistics.median(static):.2f} s {[round(s, 2) for s in static]}; subscription "
          f"(static Bearer) median {statistics.median(subscription):.2f} s "
          f"{[round(s, 2) for s in subscription]}")  # fmt: skip
    _nowhere(up, token, [connected.stdout, connected.stderr, done.stdout, done.stderr],
             {token_file})  # fmt: skip


def _codex_runs(up: Up, runs: int, gap: float) -> list[float]:
    seconds = []
    for index in range(runs):
        if index:
            time.sleep(gap)
        started = time.monotonic()
        done = _ssh(up, CODEX)
        seconds.append(round(time.monotonic() - started, 1))
        assert done.returncode == 0 and REPLY in done.stdout, (
            done.stdout[-1500:] + done.stderr[-3000:] + up.logs()
        )
    return seconds


def test_codex_chatgpt_login_rotates_and_never_reaches_the_sandbox(up: Up, tmp_path: Path) -> None:
    cvm = up.stack().state["dev_cvm_id"]
    login = _vendor(up, "POST", "/_umbra/codex-login")  # what `codex login` leaves behind
    auth = tmp_path / "auth.json"
    auth.write_text(json.dumps(login))
    refresh0 = login["tokens"]["refresh_token"].encode()
    access0 = login["tokens"]["access_token"].encode()
    connected = up.client("connect", "codex", "--auth-file", str(auth), "--json")
    assert connected.returncode == 0, connected.stderr
    result = json.loads(connected.stdout)
    assert result["cvms"] == [cvm] and result["placeholder_written"] == [cvm], result
    placeholder = _ssh(up, "cat ~/.codex/auth.json")
    assert "umbra-placeholder:personal/codex-chatgpt" in placeholder.stdout
    status = _ssh(up, "codex login status")
    assert "ChatGPT" in status.stdout + status.stderr, status.stdout + status.stderr
    # The interactive UI's first question: the workspace routing discovery, through the proxy.
    account = _ssh(up, "python3 -", stdin=ACCOUNT_READ)
    assert account.returncode == 0, account.stdout + account.stderr[-3000:] + up.logs()
    routing = json.loads(account.stdout)["result"]["workspaceRouting"]
    assert routing == {"chatgptAccountId": login["tokens"]["account_id"],
                       "backendOrigin": "https://chatgpt.com",
                       "accountRoutingOverride": "NO_CONSTRAINT"}, routing  # fmt: skip

    # Access tokens live 8 s: each run after the last one's expired, so each starts by a refresh.
    seconds = _codex_runs(up, 3, gap=9)
    static = [_timed(up, _api_key_command(up, "codex")) for _ in range(3)]
    print(f"codex exec through umbra ssh: ChatGPT login (minted, refreshed in between) {seconds} s"
          f", median {statistics.median(seconds):.2f} s; API key (static) "
          f"{[round(s, 2) for s in static]}, median {statistics.median(static):.2f} s")  # fmt: skip
    state = _vendor(up, "GET", "/_umbra/state")
    counts = state["counts"]
    assert counts.get("codex_turn", 0) >= 3 and not counts.get("chatgpt.com_refused"), counts
    assert counts.get("accounts_check", 0) >= 1, counts
    # Each run's turn went over the Responses WebSocket, the minted token in its handshake.
    assert counts.get("codex_websocket", 0) >= 3, counts
    assert counts.get("codex_turn_websocket", 0) >= 3, counts
    assert counts.get("refresh_ok", 0) >= 2, counts  # rotated across the runs
    assert not counts.get("refresh_reused") and not counts.get("refresh_refused"), counts

    # The Console holds the latest link of the chain: a fresh Security CVM (nothing cached)
    # takes the document from the Console and its refresh is accepted.
    stack = up.stack()
    stack.stop(up_stack.Component.PROXY)
    again = up.run("up", "--json")
    assert again.returncode == 0, again.stdout + again.stderr
    time.sleep(9)  # past the cached access token's life: the new proxy must refresh
    _codex_runs(up, 1, gap=0)
    final = _vendor(up, "GET", "/_umbra/state")
    assert final["counts"]["refresh_ok"] > counts["refresh_ok"], final
    assert not final["counts"].get("refresh_reused"), final

    outputs = [connected.stdout, connected.stderr, placeholder.stdout, status.stdout,
               account.stdout, account.stderr]  # fmt: skip
    for secret in (refresh0, access0):
        _nowhere(up, secret, outputs, set())

    # Codex refreshing by itself: with an expired (placeholder) access token it POSTs the
    # placeholder refresh token to auth.openai.com; the Security CVM denies that (the profile's
    # `no-login` rule), the stand-in never sees it, and Codex carries on with the token it has,
    # which the proxy replaces anyway.
    identity = json.loads(
        base64.urlsafe_b64decode(login["tokens"]["id_token"].split(".")[1] + "===")
    )
    expired = codex_placeholder_auth(identity, login["tokens"]["account_id"], time.time(), exp=1)
    wrote = _ssh(up, "cat > ~/.codex/auth.json", stdin=expired)
    assert wrote.returncode == 0, wrote.stderr
    refused_before = final["counts"].get("refresh_refused", 0) + final["counts"].get(
        "refresh_reused", 0
    )
    itself = _ssh(up, CODEX)
    tried = itself.stderr.count("Failed to refresh token")
    print(f"codex with an expired placeholder: exit {itself.returncode}, {tried} refresh errors")
    assert itself.returncode == 0 and REPLY in itself.stdout, itself.stderr[-2000:]
    after = _vendor(up, "GET", "/_umbra/state")["counts"]
    assert after.get("refresh_refused", 0) + after.get("refresh_reused", 0) == refused_before
    end = time.monotonic() + 60  # the records reach the Console from the proxy's spool
    while True:
        logs = up.client("logs", "--cvm", cvm, "--host", "auth.openai.com", "--decision", "deny",
                         "--since", "10m", "--json")  # fmt: skip
        assert logs.returncode == 0, logs.stderr
        if "auth.openai.com" in logs.stdout or time.monotonic() > end:
            break
        time.sleep(1)
    assert "auth.openai.com" in logs.stdout, logs.stdout[-1000:]

    # Disconnect takes the placeholder login out of the sandbox with the secret.
    gone = up.client("disconnect", "codex", "--json")
    assert gone.returncode == 0 and json.loads(gone.stdout)["deleted"] is True, gone.stderr
    assert _ssh(up, "test -e ~/.codex/auth.json").returncode == 1
