"""A profile's sandbox environment (`sandbox_env`): non-secret variables and placeholders a
profile puts into every sandbox it is attached to (`CLAUDE_CODE_OAUTH_TOKEN=umbra-placeholder:...`,
`AWS_ACCESS_KEY_ID=umbra-placeholder`, `AWS_REGION=us-east-1`). A value that looks like a real
credential by the scanner's rules (the built-in ones and the profile's own `scan` rules) is
refused: a reviewer must never merge a secret into the policy repository by way of an
environment variable."""

from __future__ import annotations

import re
from collections.abc import Iterable

from umbra.policy.builtin_scan import BUILTIN_SCAN_RULES

ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"
MAX_ENV_VALUE = 4096
MAX_ENV_VARS = 64
# Variables that change how every program in the sandbox loads or finds code, or where its
# traffic goes: a profile may not set them (the sandbox image and the forwarder own them).
RESERVED_ENV = frozenset(
    {
        "PATH", "HOME", "USER", "SHELL", "LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT",
        "PYTHONPATH", "PYTHONSTARTUP", "NODE_OPTIONS", "BASH_ENV", "ENV", "PROMPT_COMMAND",
        "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "http_proxy", "https_proxy",
        "all_proxy", "no_proxy", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE",
        "NODE_EXTRA_CA_CERTS", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO", "AWS_CA_BUNDLE",
    }
)  # fmt: skip


def _compiled(items: Iterable[tuple[str, str]]) -> list[tuple[str, re.Pattern[str]]]:
    rules = []
    for rule_id, pattern in items:
        try:
            rules.append((rule_id, re.compile(pattern)))
        except re.error:
            continue  # a profile's own regex is checked (and reported) where it is declared
    return rules


_BUILTIN = _compiled(BUILTIN_SCAN_RULES.items())


def credential_rule(value: str, scan: Iterable[tuple[str, str]] = ()) -> str | None:
    """The id of the first scan rule (built-in, then `scan`) `value` matches, or None."""
    for rule_id, pattern in _BUILTIN + _compiled(scan):
        if pattern.search(value):
            return rule_id
    return None


def check_env_value(name: str, value: str) -> None:
    if name in RESERVED_ENV:
        raise ValueError(f"{name} is set by the sandbox itself; a profile may not set it")
    if len(value) > MAX_ENV_VALUE:
        raise ValueError(f"longer than {MAX_ENV_VALUE} characters")
    if any(ord(char) < 0x20 or ord(char) == 0x7F for char in value):
        raise ValueError("contains a control character")
