"""The agents whose own login `umbra connect` stores (docs/specs/console.md, "Agent logins"):
for each, the developer's personal secret (name, kind, hosts) and the profile that injects it.

The Console lets a Dev CVM's owner attach and detach exactly these profiles on their own CVM
(everything else stays an admin's): the team's admin still decides what a profile of that name
allows, since only a published bundle's profile can be attached.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from umbra.contracts.secret_kinds import SecretKind


class Agent(StrEnum):
    claude = "claude"
    codex = "codex"


@dataclass(frozen=True)
class AgentLogin:
    secret: str  # personal secret name
    kind: SecretKind
    hosts: tuple[str, ...]
    profile: str


AGENT_LOGINS: dict[Agent, AgentLogin] = {
    Agent.claude: AgentLogin(
        "claude-oauth-token", SecretKind.static, ("api.anthropic.com",), "claude-subscription"
    ),
    Agent.codex: AgentLogin(
        "codex-chatgpt", SecretKind.oauth2_refresh, ("chatgpt.com",), "codex-chatgpt"
    ),
}

# Profiles a Dev CVM's owner may attach or detach on their own CVM.
SELF_SERVICE_PROFILES: frozenset[str] = frozenset(a.profile for a in AGENT_LOGINS.values())
