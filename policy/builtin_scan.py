"""The secret-scan rules every effective policy carries, whatever its profiles say.

Patterns use only the regular-expression subset that Hyperscan and RE2 accept (no look-around, no
back-references), so the proxy can run all of them in one multi-pattern pass. They carry no `\b`:
length-prefixed encodings (protobuf, msgpack) put a letter right before a token, and a key ending
in `-` or `_` has no word boundary after it at the end of a string; a few more false positives are
the price of not missing those.
"""

from __future__ import annotations

BUILTIN_PREFIX = "builtin:"

BUILTIN_SCAN_RULES: dict[str, str] = {
    "builtin:github-token": r"(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{36,255}",
    "builtin:github-fine-grained-pat": r"github_pat_[A-Za-z0-9_]{82}",
    "builtin:aws-access-key-id": r"(?:AKIA|ASIA|ABIA|ACCA)[A-Z2-7]{16}",
    "builtin:aws-secret-access-key": (
        r"(?i:aws_?secret_?access_?key|aws_?secret)[\"' ]*[:=][\"' ]*[A-Za-z0-9/+]{40}"
    ),
    "builtin:anthropic-api-key": r"sk-ant-(?:api|admin)[0-9]{2}-[A-Za-z0-9_-]{80,120}",
    "builtin:openai-api-key": r"sk-(?:proj-|svcacct-|admin-)?[A-Za-z0-9_-]{20,}T3BlbkFJ[A-Za-z0-9_-]{20,}",
    "builtin:slack-token": r"xox[abposr]-[0-9A-Za-z-]{10,250}",
    "builtin:slack-webhook": r"https://hooks\.slack\.com/services/T[A-Z0-9]+/B[A-Z0-9]+/[A-Za-z0-9]{20,}",
    "builtin:gcp-api-key": r"AIza[0-9A-Za-z_-]{35}",
    "builtin:gcp-service-account-key": r"\"private_key_id\"\s*:\s*\"[0-9a-f]{40}\"",
    "builtin:stripe-secret-key": r"(?:sk|rk)_(?:live|test)_[0-9A-Za-z]{24,99}",
    "builtin:pem-private-key": r"-----BEGIN (?:[A-Z0-9]+ )?PRIVATE KEY(?: BLOCK)?-----",
}
