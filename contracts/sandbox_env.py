"""What a sandbox environment variable may be: the one rule the policy linter applies to a
profile's `sandbox_env` and the forwarder applies again to the Security CVM's `env` answer
before a byte of it reaches `sandbox.env` (docs/specs/sandbox.md, "The sandbox environment").

The forwarder checks again because the file is sourced by every login shell in the sandbox: a
name like LD_PRELOAD or HTTPS_PROXY there would change how every program loads or where its
traffic goes, so a bad answer is refused whole (the last attested environment stays).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"
MAX_ENV_VALUE = 4096
MAX_ENV_VARS = 64  # per profile (the linter); the forwarder bounds the answer's bytes instead
# Variables that change how every program in the sandbox loads or finds code, or where its
# traffic goes: a profile may not set them (the sandbox image and the forwarder own them). Every
# name of a CVM's own values (local_cvm.sandbox_env_base) is here: a test keeps them in step.
RESERVED_ENV = frozenset(
    {
        "PATH", "HOME", "USER", "SHELL", "LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT",
        "PYTHONPATH", "PYTHONSTARTUP", "NODE_OPTIONS", "BASH_ENV", "ENV", "PROMPT_COMMAND",
        "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "http_proxy", "https_proxy",
        "all_proxy", "no_proxy", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE",
        "NODE_EXTRA_CA_CERTS", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO", "AWS_CA_BUNDLE", "PIP_CERT",
    }
)  # fmt: skip
_NAME = re.compile(ENV_NAME)


def check_env_value(name: str, value: str) -> None:
    """Raise ValueError (the reason, without the value) if `name=value` may not be set."""
    if name in RESERVED_ENV:
        raise ValueError(f"{name} is set by the sandbox itself; a profile may not set it")
    if len(value) > MAX_ENV_VALUE:
        raise ValueError(f"longer than {MAX_ENV_VALUE} characters")
    if any(ord(char) < 0x20 or ord(char) == 0x7F for char in value):
        raise ValueError("contains a control character")


def check_env(env: Mapping[str, str]) -> None:
    """Every entry of a whole environment (the forwarder's check of an `env` answer): raise
    ValueError naming the first bad variable (never its value: it may be a placeholder
    someone mistook for a secret, or a secret)."""
    for name, value in env.items():
        if not _NAME.match(name):
            raise ValueError(f"variable name {name[:64]!r} does not match {ENV_NAME}")
        try:
            check_env_value(name, value)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
