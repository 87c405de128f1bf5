"""The real Claude Code (`claude -p`) and Codex (`codex exec`), pinned from npm, through the real
proxy to the stand-in model API: the sandbox side holds placeholders, the proxy injects the real
keys, the stand-in checks them, and the keys appear nowhere the client or the logs can see.

This runs `umbra up --check`'s agent step (`cli/up_agents.run_agents`) with a runner on this host
that gives the agents only the environment a sandbox login gives (proxy, CA), a clean HOME and no
network but loopback. The agents are installed once per machine into a cache
(`$UMBRA_TEST_AGENT_CACHE`, default ~/.cache/umbra/test-agents): about 25 s and 800 MB on a miss.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from tests.agents.stack import Stack, start_stack
from umbra.cli.llm_origin import Api, OriginConfig, OriginServer, serve
from umbra.cli.up_agents import (
    Endpoints,
    SandboxRunner,
    run_agents,
    standin_profiles,
)
from umbra.sandbox.image import CLAUDE_CODE_VERSION, CODEX_VERSION

LLM = "llm.test"
ANTHROPIC_KEY = "sk-ant-api03-UMBRATESTKEY-" + "a1b2c3d4e5f6a7b8c9d0" * 3 + "-AA"
OPENAI_KEY = "sk-proj-UMBRATESTKEY" + "f0e1d2c3b4a59687" * 4


def agent_bin() -> Path:
    """The pinned agents' bin directory, installed from npm once into the shared cache."""
    root = Path(os.environ.get("UMBRA_TEST_AGENT_CACHE", "~/.cache/umbra/test-agents"))
    target = root.expanduser() / f"claude-{CLAUDE_CODE_VERSION}-codex-{CODEX_VERSION}"
    if not (target / ".complete").exists():
        staging = target.with_name(target.name + f".tmp{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        done = subprocess.run(
            [
                "npm", "install", "--prefix", str(staging), "--no-audit", "--no-fund",
                "--no-update-notifier", "--loglevel", "error",
                f"@anthropic-ai/claude-code@{CLAUDE_CODE_VERSION}", f"@openai/codex@{CODEX_VERSION}",
            ],
            capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"npm install of the pinned agents failed: {done.stderr[-800:]}")
        (staging / ".complete").write_text("ok\n")
        with contextlib.suppress(OSError):  # another run finished first: use its copy
            staging.rename(target)
        shutil.rmtree(staging, ignore_errors=True)
    return target / "node_modules" / ".bin"


@pytest.fixture(scope="module")
def agents() -> Path:
    if shutil.which("npm") is None:
        pytest.fail("npm is needed to install the pinned agents (scripts/system-deps)")
    return agent_bin()


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, OriginServer]]:
    config = OriginConfig(
        {
            Api.ANTHROPIC: hashlib.sha256(ANTHROPIC_KEY.encode()).hexdigest(),
            Api.OPENAI: hashlib.sha256(OPENAI_KEY.encode()).hexdigest(),
        }
    )
    servers: list[OriginServer] = []

    def start_llm(cert: Path, key: Path) -> dict[str, str]:
        server = serve(config, str(cert), str(key))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return standin_profiles(LLM, server.port)

    profiles = standin_profiles(LLM, 0)
    stack = start_stack(
        tmp_path_factory.mktemp("agents"),
        [LLM],
        {
            name: text.replace("ports: [0]", "ports: [{llm_port}]")
            for name, text in profiles.items()
        },
        attached=sorted(profiles),
        secrets={
            "team": {"anthropic-api-key": ANTHROPIC_KEY},
            "personal": {"alice": {"openai-api-key": OPENAI_KEY}},
        },
        before_proxy=start_llm,
    )
    yield stack, servers[0]
    output = stack.stop()
    servers[0].shutdown()
    spool = b"".join(p.read_bytes() for p in (stack.workdir / "spool").rglob("*.jsonl"))
    for key in (ANTHROPIC_KEY, OPENAI_KEY):
        assert key not in output, "a real key appeared in the proxy's output"
        assert key.encode() not in spool, "a real key appeared in the traffic log"


class HostRunner:
    """What a sandbox login gives an agent, on this host: the proxy and its CA in every tool's
    variable, a clean HOME, nothing of the caller's environment."""

    def __init__(self, stack: Stack, bin_dir: Path, home: Path) -> None:
        self.stack, self.bin_dir, self.home = stack, bin_dir, home
        self.seen_env: list[dict[str, str]] = []
        self.outputs: list[str] = []

    def __call__(
        self, argv: Sequence[str], env: Mapping[str, str], timeout: float
    ) -> subprocess.CompletedProcess[str]:
        ca = str(self.stack.proxy.ca)
        login = {
            "PATH": f"{self.bin_dir}:/usr/local/bin:/usr/bin:/bin",
            "HOME": str(self.home),
            "LANG": "C.UTF-8",
            "TERM": "dumb",
            "HTTPS_PROXY": self.stack.proxy_url,
            "HTTP_PROXY": self.stack.proxy_url,
            "https_proxy": self.stack.proxy_url,
            "http_proxy": self.stack.proxy_url,
            "NODE_EXTRA_CA_CERTS": ca,
            "SSL_CERT_FILE": ca,
            "CODEX_CA_CERTIFICATE": ca,
        }
        full = {**login, **env}
        self.seen_env.append(full)
        work = self.home / "work"
        work.mkdir(exist_ok=True)
        done = subprocess.run(
            list(argv), env=full, cwd=work, capture_output=True, text=True,
            timeout=timeout, stdin=subprocess.DEVNULL, check=False,
        )  # fmt: skip
        self.outputs += [done.stdout, done.stderr]
        return done


def test_claude_and_codex_reach_the_stand_in_with_the_injected_key(
    agents: Path, llm: tuple[Stack, OriginServer], tmp_path: Path
) -> None:
    stack, origin = llm
    home = tmp_path / "home"
    home.mkdir()
    runner = HostRunner(stack, agents, home)
    checked: SandboxRunner = runner
    base = f"https://{LLM}:{origin.port}"
    mark = stack.proxy.log.mark()
    results = run_agents(checked, Endpoints(base, base + "/v1"), deadline=120)
    for result in results:
        assert result.ok, result.detail
    seen = origin.config.seen
    assert any(s.api is Api.ANTHROPIC and s.path == "/v1/messages" and s.key_ok for s in seen)
    assert any(s.api is Api.OPENAI and s.path == "/v1/responses" and s.key_ok for s in seen)
    assert any(s.stream for s in seen), "the agents streamed"
    assert all(s.key_ok for s in seen), "every call reached the stand-in with the real key"
    # The proxy injected each key, and wrote it nowhere; the agents never had it.
    records = stack.proxy.log.settled()[mark:]
    # Update checks, telemetry and catalogues are off: the agents called the stand-in only.
    assert {(r["connect_host"], r["decision"]) for r in records} == {(LLM, "allow")}, records
    assert any(r["injected_headers"] == ["x-api-key"] for r in records)
    assert any(r["injected_headers"] == ["Authorization"] for r in records)
    for key in (ANTHROPIC_KEY, OPENAI_KEY):
        assert all(key not in value for env in runner.seen_env for value in env.values())
        assert all(key not in text for text in runner.outputs)
        for path in home.rglob("*"):
            if path.is_file():
                assert key.encode() not in path.read_bytes(), f"a real key in {path}"
    print({r.name: r.seconds for r in results})
