"""`umbra up --check`: the walkthrough, run inside the Dev CVM's sandbox as its root.

Four requests through the sandbox's only exit (the forwarder, then the attested Security CVM):
1. allowed, with the team's demo token injected by the Security CVM (the sandbox never holds it);
2. a host no profile allows;
3. a method the profile does not allow;
4. an exfiltration attempt: a credential planted in the sandbox sent to an allowed host.
Then the four records must show up in the Console's traffic log, attributed to the CVM.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from umbra.cli.up_agents import AgentResult, Endpoints, SandboxRunner, run_agents
from umbra.cli.up_stack import DEMO_HOSTS, LLM_HOST, TEAM, Stack, UpError, umbra_executable
from umbra.contracts.traffic import Decision
from umbra.sandbox import local_cvm

# A fake AWS access key id: the shape the built-in scanner knows, valid for nothing.
PLANTED = "AKIA" + "UMBRADEMOPLANTED"
# In the sandbox user's home: the checks run as that user, with its login environment.
CREDENTIALS = "/home/dev/.aws/credentials"
BODY = "/home/dev/umbra-check-body"


@dataclass(frozen=True)
class Probe:
    name: str
    method: str
    host: str
    path: str
    expect_status: int
    expect_decision: Decision
    body: str | None = None


def probes() -> list[Probe]:
    api, evil = DEMO_HOSTS
    return [
        Probe("allowed, credential injected", "GET", api, "/v1/whoami", 200, Decision.ALLOW),
        Probe("host not allowed", "GET", evil, "/", 403, Decision.DENY),
        Probe("method not allowed", "DELETE", api, "/v1/items/1", 403, Decision.DENY),
        Probe(
            "exfiltration of a planted secret", "POST", api, "/v1/upload", 403, Decision.DENY, "@"
        ),
    ]


def _curl(stack: Stack, plan: local_cvm.LocalCvmPlan, probe: Probe) -> tuple[int, str]:
    """curl as the sandbox's user with the sandbox's own environment: its proxy variables and
    its system CA store (no --proxy, no --cacert), as an agent's tools run."""
    url = f"https://{probe.host}:{stack.port('origin')}{probe.path}"
    argv = [
        "curl", "-sS", "--max-time", "20", "-o", BODY, "-w", "%{http_code}", "-X", probe.method,
    ]  # fmt: skip
    if probe.body is not None:
        argv += ["--data-binary", f"@{CREDENTIALS}"]
    done = local_cvm.run_in_sandbox(plan, [*argv, url], timeout=60)
    code = int(done.stdout.strip() or 0) if done.stdout.strip().isdigit() else 0
    return code, done.stderr.strip()[:200]


def plant_secret(plan: local_cvm.LocalCvmPlan) -> None:
    script = (
        f"mkdir -p {CREDENTIALS.rsplit('/', 1)[0]} && "
        f"printf '[default]\\naws_access_key_id = %s\\n' {PLANTED} > {CREDENTIALS}"
    )
    done = local_cvm.run_in_sandbox(plan, ["sh", "-c", script], timeout=30)
    if done.returncode != 0:
        raise UpError(f"could not plant the test secret in the sandbox: {done.stderr.strip()}")


def injected(plan: local_cvm.LocalCvmPlan, secret: str) -> bool:
    """Did the origin receive `Bearer <secret>`? It answers with the header's hash only."""
    done = local_cvm.run_in_sandbox(plan, ["cat", BODY], timeout=30)
    try:
        seen = json.loads(done.stdout).get("authorization_sha256")
    except ValueError:
        return False
    return bool(seen == hashlib.sha256(f"Bearer {secret}".encode()).hexdigest())


def run_check(
    stack: Stack, client: httpx.Client, cvm_id: str, report: Any, secret: str
) -> list[dict[str, Any]]:
    plan = local_cvm.load_plan(stack.p("cvms"), cvm_id)
    if plan is None:
        raise UpError(f"no local Dev CVM {cvm_id} on disk", "run `umbra up` first")
    plant_secret(plan)
    started = time.time()
    # The first request may wait for the Security CVM's first bundle and secret release.
    results: list[tuple[Probe, int]] = []
    for probe in probes():
        end = time.monotonic() + 60
        while True:
            code, error = _curl(stack, plan, probe)
            if code == probe.expect_status or time.monotonic() > end:
                break
            time.sleep(0.5)
        if probe.expect_decision == Decision.ALLOW and code == 200 and not injected(plan, secret):
            raise UpError("the allowed request reached the origin without the injected token")
        results.append((probe, code))
        report(probe, code, error)
    wrong = [(p.name, c) for p, c in results if c != p.expect_status]
    if wrong:
        raise UpError(f"the walkthrough got unexpected answers: {wrong}", "see `umbra status`")
    return wait_records(client, cvm_id, started)


def wait_records(client: httpx.Client, cvm_id: str, since: float) -> list[dict[str, Any]]:
    """This run's four records, as the Console shows them (newest first)."""
    want = {(p.method, p.host, p.expect_decision) for p in probes()}
    after = datetime.fromtimestamp(since - 2, UTC)
    end = time.monotonic() + 60
    seen: list[dict[str, Any]] = []
    while time.monotonic() < end:
        page = client.get(f"/api/v1/teams/{TEAM}/traffic", params={"cvm_id": cvm_id, "limit": 200})
        if page.status_code == 200:
            seen = [
                r
                for r in page.json()["records"]
                if r.get("cvm_id") == cvm_id
                and datetime.fromisoformat(r["time"]) >= after
                and (r.get("method"), r.get("connect_host"), r.get("decision")) in want
            ]
            if {(r["method"], r["connect_host"], r["decision"]) for r in seen} >= want:
                return seen
        time.sleep(0.5)
    raise UpError(
        f"the Console did not receive all four records within 60s (got {len(seen)})",
        "see logs/proxy.log in the state directory",
    )


@dataclass(frozen=True)
class InternetResult:
    name: str
    host: str
    ok: bool
    exit_code: int | None  # None: killed at the deadline
    seconds: float
    detail: str

    def as_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok, "host": self.host, "exit_code": self.exit_code,
            "seconds": self.seconds, "detail": self.detail,
        }  # fmt: skip


def internet_commands(proxy: str, targets: dict[str, str]) -> dict[str, tuple[str, list[str]]]:
    """name -> (host, argv run in the sandbox). Isolated from the host's tool configuration (the
    sandbox's own settings): only the proxy, its CA and the target are used, and each tool
    gives up on its own before the deadline."""
    ca = "/etc/ssl/certs/ca-certificates.crt"  # the sandbox's system store: it holds the CA
    # A clean environment: nothing of the caller's (its CA bundles, proxies, tokens) leaks in.
    clean = ["env", "-i", "PATH=/usr/local/bin:/usr/bin:/bin", "HOME=/root", "LANG=C.UTF-8"]
    pip = [
        *clean, "python3", "-m", "pip", "download", "--isolated", "--no-deps", "--no-cache-dir",
        "--disable-pip-version-check", "--proxy", proxy, "--cert", ca,
        "--index-url", targets["pypi_index"], "--timeout", "20", "--retries", "0",
        "-d", "/root/umbra-internet-check", targets["package"],
    ]  # fmt: skip
    git = [
        *clean, "GIT_CONFIG_GLOBAL=/dev/null", "GIT_CONFIG_NOSYSTEM=1", "GIT_TERMINAL_PROMPT=0",
        f"GIT_SSL_CAINFO={ca}", f"HTTPS_PROXY={proxy}",
        "git", "-c", f"http.proxy={proxy}",
        "-c", "http.lowSpeedLimit=1", "-c", "http.lowSpeedTime=20",
        "ls-remote", targets["git_url"], "HEAD",
    ]  # fmt: skip
    return {
        "pip download": (str(httpx.URL(targets["pypi_index"]).host), pip),
        "git ls-remote": (str(httpx.URL(targets["git_url"]).host), git),
    }


def run_internet(
    stack: Stack,
    cvm_id: str,
    targets: dict[str, str] | None = None,
    deadline: float = 90,
    report: Any = None,
) -> list[InternetResult]:
    """Real tools against real hosts through the Security CVM, inside the sandbox. Each check
    passes or fails on its own with a reason (a host that did not resolve on this machine is
    named as unreachable); none runs past `deadline` seconds."""
    from umbra.cli.up_stack import internet_targets

    plan = local_cvm.load_plan(stack.p("cvms"), cvm_id)
    if plan is None:
        raise UpError(f"no local Dev CVM {cvm_id} on disk", "run `umbra up` first")
    proxy = f"http://{plan.forwarder_addr}:{local_cvm.SANDBOX_PROXY_PORT}"
    unresolved = set(stack.state.get("internet_unresolved", []))
    results = []
    for name, (host, argv) in internet_commands(proxy, targets or internet_targets()).items():
        started = time.monotonic()
        try:
            done = subprocess.run(
                local_cvm.exec_argv(plan, argv), capture_output=True, text=True, timeout=deadline
            )
            code: int | None = done.returncode
            output = " ".join((done.stderr.strip() or done.stdout.strip()).split())
        except subprocess.TimeoutExpired:
            code, output = None, f"no answer within {deadline:.0f} s (killed)"
        seconds = round(time.monotonic() - started, 1)
        if code == 0:
            detail = f"{name} via the Security CVM: ok"
        elif host in unresolved:
            detail = f"unreachable: {host} does not resolve on this machine; " + output[-200:]
        else:
            detail = f"failed (exit {code}): " + output[-300:]
        result = InternetResult(name, host, code == 0, code, seconds, detail)
        if report is not None:
            report(result)
        results.append(result)
    return results


def run_ssh_check(cvm_id: str) -> dict[str, Any]:
    """The fifth check: `umbra ssh CVM -- id -u` as a developer runs it (the Console's session
    info, aTLS, the quote checked against the release, CVM id, keys and host key, then sshd),
    answering the sandbox user's uid. The warm ssh agent it starts is stopped afterwards."""
    with tempfile.TemporaryDirectory(prefix="umbra-up-ssh-") as tmp:
        env = {**os.environ, "TMPDIR": tmp}
        try:
            done = subprocess.run(
                [umbra_executable(), "ssh", "--no-reuse", cvm_id, "--", "id", "-u"],
                capture_output=True, text=True, timeout=90, env=env, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        finally:
            for pid_file in Path(tmp).glob("umbra-ssh-*/agent-*.pid"):
                with contextlib.suppress(OSError, ValueError):
                    os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
    uid = done.stdout.strip()
    if done.returncode != 0 or uid != str(local_cvm.SANDBOX_USER_UID):
        raise UpError(
            f"`umbra ssh {cvm_id} -- id -u` failed (exit {done.returncode}): "
            f"{(done.stderr.strip() or uid)[-400:]}",
            "see `umbra status` and the CVM's ingress.log",
        )
    return {"ok": True, "detail": f"umbra ssh {cvm_id} -- id -u → {uid} (the sandbox user)"}


def run_agent_check(
    run: SandboxRunner, endpoints: Endpoints, report: Any = None, deadline: float = 120
) -> list[AgentResult]:
    """The agent step (`cli/up_agents.py`): the real `claude -p` and `codex exec` in the sandbox
    against the stand-in model API, the keys injected by the Security CVM. `run` is the sandbox's
    "argv as the developer with the login environment" (the runtime provides it); a failure is an
    UpError naming the agent and its last output."""
    results = run_agents(run, endpoints, deadline)
    for result in results:
        if report is not None:
            report(result)
    failed = [result.detail for result in results if not result.ok]
    if failed:
        raise UpError("the agents did not complete a turn: " + "; ".join(failed),
                      "see logs/proxy.log and `umbra logs` for what was refused")  # fmt: skip
    return results


def sandbox_runner(stack: Stack, cvm_id: str) -> SandboxRunner:
    """The local Dev CVM's runner for the agent step: the argv as the developer with the login
    environment plus `env` (`env` takes the variables, so no value passes through a shell)."""
    plan = local_cvm.load_plan(stack.p("cvms"), cvm_id)
    if plan is None:
        raise UpError(f"no local Dev CVM {cvm_id} on disk", "run `umbra up` first")

    def run(
        argv: Sequence[str], env: Mapping[str, str], timeout: float
    ) -> subprocess.CompletedProcess[str]:
        command = ["env", *(f"{k}={v}" for k, v in env.items()), *argv]
        try:
            return local_cvm.run_in_sandbox(plan, command, user="dev", timeout=timeout)
        except local_cvm.LocalCvmError:
            raise subprocess.TimeoutExpired(command, timeout) from None

    return run


def llm_endpoints(stack: Stack) -> Endpoints:
    base = f"https://{LLM_HOST}:{stack.port('llm')}"
    return Endpoints(anthropic_base_url=base, openai_base_url=base + "/v1")
