"""`up --check`'s agent step with a stand-in runner: what it asks the sandbox to run, and how it
fails (the real agents through the real proxy: test_agents_e2e.py)."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence

import pytest

from umbra.cli.llm_origin import REPLY
from umbra.cli.up_agents import Endpoints, agent_commands
from umbra.cli.up_check import run_agent_check
from umbra.cli.up_stack import UpError

ENDPOINTS = Endpoints("https://llm.demo.test:8443", "https://llm.demo.test:8443/v1")


def test_the_agents_hold_placeholders_and_point_at_the_stand_in() -> None:
    claude, codex = agent_commands(ENDPOINTS)
    assert claude.argv[:3] == ["claude", "-p", "say hi"]
    assert claude.env["ANTHROPIC_BASE_URL"] == ENDPOINTS.anthropic_base_url
    assert claude.env["ANTHROPIC_API_KEY"] == "umbra-placeholder:team/anthropic-api-key"
    assert claude.env["DISABLE_AUTOUPDATER"] == "1"
    assert codex.argv[:2] == ["codex", "exec"]
    assert any(ENDPOINTS.openai_base_url in arg for arg in codex.argv)
    assert codex.env["OPENAI_API_KEY"] == "umbra-placeholder:personal/openai-api-key"


def test_a_failing_agent_fails_the_check_with_its_output() -> None:
    def run(
        argv: Sequence[str], env: Mapping[str, str], timeout: float
    ) -> subprocess.CompletedProcess[str]:
        if argv[0] == "claude":
            return subprocess.CompletedProcess(list(argv), 0, REPLY + "\n", "")
        return subprocess.CompletedProcess(list(argv), 1, "", "401 stand-in refused the key")

    with pytest.raises(UpError, match="codex exec failed \\(exit 1\\): 401 stand-in"):
        run_agent_check(run, ENDPOINTS)


def test_an_agent_past_its_deadline_is_reported() -> None:
    def run(
        argv: Sequence[str], env: Mapping[str, str], timeout: float
    ) -> subprocess.CompletedProcess[str]:
        raise subprocess.TimeoutExpired(list(argv), timeout)

    with pytest.raises(UpError, match="no answer within 5 s"):
        run_agent_check(run, ENDPOINTS, deadline=5)
