"""`umbra up --check`'s agent step: the real `claude -p` and `codex exec`, run in the sandbox
against the stand-in model API (`cli/llm_origin.py`) through the Security CVM.

The sandbox holds only placeholders (`ANTHROPIC_API_KEY=umbra-placeholder:team/…`); the proxy
replaces the header with the real key, which the stand-in checks (it answers 401 otherwise, so a
reply proves the injection). Each agent gets a bounded time and no network but the proxy, with its
update checks and telemetry off by the variables each documents.

The step runs through a `SandboxRunner`: "run this argv in the sandbox as the developer, with the
login environment plus these variables". The sandbox image and its runner come from the runtime;
tests use a runner that runs on the host with the proxy environment a sandbox login sets.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from umbra.cli.llm_origin import REPLY

ANTHROPIC_KEY_REF = "team/anthropic-api-key"
OPENAI_KEY_REF = "personal/openai-api-key"
PROMPT = "say hi"

# Claude Code: no auto-update, telemetry, error reports or other non-essential calls.
CLAUDE_QUIET = {
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_BUG_COMMAND": "1",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1",
}


class SandboxRunner(Protocol):
    """Run `argv` in the sandbox as the developer, with the login environment plus `env`."""

    def __call__(
        self, argv: Sequence[str], env: Mapping[str, str], timeout: float
    ) -> subprocess.CompletedProcess[str]: ...


@dataclass(frozen=True)
class Endpoints:
    """Where the stand-in answers, as the sandbox names it (through the proxy)."""

    anthropic_base_url: str  # e.g. https://llm.demo.test:8443 (Claude Code appends /v1/messages)
    openai_base_url: str  # e.g. https://llm.demo.test:8443/v1 (Codex appends /responses)


@dataclass(frozen=True)
class AgentCommand:
    name: str
    argv: list[str]
    env: dict[str, str]


@dataclass(frozen=True)
class AgentResult:
    name: str
    ok: bool
    exit_code: int | None  # None: killed at the deadline
    seconds: float
    detail: str

    def as_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "exit_code": self.exit_code, "seconds": self.seconds,
                "detail": self.detail}  # fmt: skip


def standin_profiles(host: str, port: int) -> dict[str, str]:
    """The two profiles that let the agents reach the stand-in at `host:port`, each injecting its
    API's key (the same grants the shipped `anthropic` and `openai` profiles give the real APIs)."""
    anthropic = f"""apiVersion: umbra/v1
kind: Profile
name: anthropic-standin
description: The stand-in model API (Anthropic Messages) for up --check; the team key injected.
egress:
  - id: messages
    allow: {{hosts: [{host}], methods: [POST], ports: [{port}],
             paths: ["/v1/messages", "/v1/messages/count_tokens"]}}
  - id: models
    allow: {{hosts: [{host}], methods: [GET], ports: [{port}], paths: ["/v1/models", "/v1/models/*"]}}
inject:
  - {{id: api-key, header: x-api-key, format: "{{secret}}", secret: {ANTHROPIC_KEY_REF},
     hosts: [{host}], ports: [{port}]}}
# Every session of a CVM this is attached to (not the image) holds the key's placeholder.
sandbox_env:
  ANTHROPIC_API_KEY: "umbra-placeholder:{ANTHROPIC_KEY_REF}"
"""
    openai = f"""apiVersion: umbra/v1
kind: Profile
name: openai-standin
description: The stand-in model API (OpenAI Responses) for up --check; the developer's key injected.
egress:
  - id: inference
    allow: {{hosts: [{host}], methods: [POST], ports: [{port}],
             paths: ["/v1/responses", "/v1/chat/completions"]}}
  - id: models
    allow: {{hosts: [{host}], methods: [GET], ports: [{port}], paths: ["/v1/models", "/v1/models/*"]}}
inject:
  - {{id: api-key, header: Authorization, format: "Bearer {{secret}}", secret: {OPENAI_KEY_REF},
     hosts: [{host}], ports: [{port}]}}
sandbox_env:
  OPENAI_API_KEY: "umbra-placeholder:{OPENAI_KEY_REF}"
"""
    return {"anthropic-standin": anthropic, "openai-standin": openai}


def agent_commands(endpoints: Endpoints, prompt: str = PROMPT) -> list[AgentCommand]:
    claude = AgentCommand(
        "claude -p",
        ["claude", "-p", prompt, "--output-format", "text"],
        {
            **CLAUDE_QUIET,
            "ANTHROPIC_BASE_URL": endpoints.anthropic_base_url,
            "ANTHROPIC_API_KEY": f"umbra-placeholder:{ANTHROPIC_KEY_REF}",
        },
    )
    # Codex reads a provider from config; `-c` overrides keep the user's config.toml untouched.
    provider = (
        '{name="Umbra stand-in", '
        f'base_url="{endpoints.openai_base_url}", '
        'env_key="OPENAI_API_KEY", wire_api="responses", '
        "request_max_retries=0, stream_max_retries=0}"
    )
    codex = AgentCommand(
        "codex exec",
        [
            "codex", "exec", "--skip-git-repo-check", "--ephemeral", "--color", "never",
            "--sandbox", "read-only",
            "-c", "model_provider=umbra", "-c", f"model_providers.umbra={provider}",
            "-c", "model=umbra-stand-in", "-c", "check_for_update_on_startup=false",
            "-c", "analytics.enabled=false", "-c", "feedback.enabled=false",
            # Plugin and app catalogues (GitHub, chatgpt.com) and in-app updates: not needed for a
            # turn, and the proxy would deny them anyway.
            "--disable", "plugins", "--disable", "remote_plugin", "--disable", "apps",
            "--disable", "plugin_sharing", "--disable", "in_app_updates",
            prompt,
        ],
        {"OPENAI_API_KEY": f"umbra-placeholder:{OPENAI_KEY_REF}", "NO_COLOR": "1"},
    )  # fmt: skip
    return [claude, codex]


def run_agents(
    run: SandboxRunner, endpoints: Endpoints, deadline: float = 120, reply: str = REPLY
) -> list[AgentResult]:
    """Each agent once; it passes when it exits 0 with the stand-in's reply on stdout."""
    results = []
    for command in agent_commands(endpoints):
        started = time.monotonic()
        try:
            done = run(command.argv, command.env, deadline)
            code: int | None = done.returncode
            output, errors = done.stdout, done.stderr
        except subprocess.TimeoutExpired:
            code, output, errors = None, "", f"no answer within {deadline:.0f} s (killed)"
        seconds = round(time.monotonic() - started, 1)
        ok = code == 0 and reply in output
        if ok:
            detail = f"{command.name}: the stand-in's reply came back"
        else:
            tail = " ".join((errors.strip() or output.strip()).split())[-300:]
            detail = f"{command.name} failed (exit {code}): {tail}"
        results.append(AgentResult(command.name, ok, code, seconds, detail))
    return results
