"""The agents whose own login `umbra connect` stores (docs/specs/console.md, "Agent logins"):
for each, the developer's personal secret (name, kind, hosts) and the profile that injects it.

The Console lets a Dev CVM's owner attach and detach exactly these profiles on their own CVM
(everything else stays an admin's): the team's admin still decides what a profile of that name
allows, since only a published bundle's profile can be attached.
"""

from __future__ import annotations

import base64
import json
import time
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

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
    # API-key profiles that shadow the login when attached beside it: `anthropic` injects its
    # x-api-key on the same host (the API then bills the key), `anthropic-standin` (umbra up)
    # puts ANTHROPIC_API_KEY into the sandbox, which Claude Code prefers.
    shadowed_by: tuple[str, ...] = ()


AGENT_LOGINS: dict[Agent, AgentLogin] = {
    Agent.claude: AgentLogin(
        "claude-oauth-token",
        SecretKind.static,
        ("api.anthropic.com",),
        "claude-subscription",
        ("anthropic", "anthropic-standin"),
    ),
    Agent.codex: AgentLogin(
        "codex-chatgpt", SecretKind.oauth2_refresh, ("chatgpt.com",), "codex-chatgpt"
    ),
}

# Profiles a Dev CVM's owner may attach or detach on their own CVM.
SELF_SERVICE_PROFILES: frozenset[str] = frozenset(a.profile for a in AGENT_LOGINS.values())


# What the sandbox's `~/.codex/auth.json` holds after `umbra connect codex`: Codex signed in with
# ChatGPT, every token a placeholder. Codex reads the JWTs' claims without verifying them; the
# proxy replaces `Authorization` on chatgpt.com with the minted access token.
CODEX_PLACEHOLDER_REF = f"personal/{AGENT_LOGINS[Agent.codex].secret}"
CODEX_PLACEHOLDER = f"umbra-placeholder:{CODEX_PLACEHOLDER_REF}"
# Far ahead: Codex (0.171) refreshes when the access token's `exp` has passed (or after a 401),
# not on `last_refresh`'s age, so it never tries to refresh the placeholder by itself.
CODEX_PLACEHOLDER_EXP = 4_102_444_800  # 2100-01-01
OPENAI_AUTH_CLAIM = "https://api.openai.com/auth"


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _placeholder_jwt(claims: dict[str, Any]) -> str:
    header = _b64url(json.dumps({"alg": "none", "typ": "JWT"}, sort_keys=True).encode())
    body = _b64url(json.dumps(claims, sort_keys=True).encode())
    return f"{header}.{body}.{_b64url(CODEX_PLACEHOLDER.encode())}"


def codex_placeholder_auth(
    identity: dict[str, Any],
    account_id: str | None,
    now: float,
    exp: int = CODEX_PLACEHOLDER_EXP,
) -> str:
    """The placeholder `auth.json` for the sandbox, from the login's non-secret identity claims
    (`aud`, `email`, the `https://api.openai.com/auth` claim: account id and plan, which Codex
    sends as `chatgpt-account-id` and matches against its workspace discovery). `last_refresh`
    is `now`, so Codex does not decide on its own that the login is due a refresh."""
    keep = ("aud", "email", OPENAI_AUTH_CLAIM)
    claims = {k: identity[k] for k in keep if k in identity} | {"exp": exp}
    auth = claims.get(OPENAI_AUTH_CLAIM)
    account = auth.get("chatgpt_account_id") if isinstance(auth, dict) else None
    account = account if isinstance(account, str) else account_id
    tokens: dict[str, Any] = {
        "id_token": _placeholder_jwt(claims),
        "access_token": _placeholder_jwt(claims),
        "refresh_token": CODEX_PLACEHOLDER,
    }
    if isinstance(account, str):
        tokens["account_id"] = account
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))
    return json.dumps({"OPENAI_API_KEY": None, "last_refresh": stamp, "tokens": tokens}, indent=2)
