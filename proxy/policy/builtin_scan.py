"""The secret-scan rules every effective policy carries, whatever its profiles say.

Patterns use only the regular-expression subset that Hyperscan and RE2 accept (no look-around, no
back-references), so the proxy can run all of them in one multi-pattern pass.
"""

from __future__ import annotations

BUILTIN_PREFIX = "builtin:"

BUILTIN_SCAN_RULES: dict[str, str] = {
    "builtin:github-token": r"\b(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{36,255}\b",
    "builtin:github-fine-grained-pat": r"\bgithub_pat_[A-Za-z0-9_]{82}\b",
    "builtin:aws-access-key-id": r"\b(?:AKIA|ASIA|ABIA|ACCA)[A-Z2-7]{16}\b",
    "builtin:aws-secret-access-key": (
        r"(?i:aws_?secret_?access_?key|aws_?secret)[\"' ]*[:=][\"' ]*[A-Za-z0-9/+]{40}"
    ),
    "builtin:anthropic-api-key": r"\bsk-ant-(?:api|admin)[0-9]{2}-[A-Za-z0-9_-]{80,120}",
    "builtin:openai-api-key": r"\bsk-(?:proj-|svcacct-|admin-)?[A-Za-z0-9_-]{20,}T3BlbkFJ[A-Za-z0-9_-]{20,}",
    "builtin:slack-token": r"\bxox[abposr]-[0-9A-Za-z-]{10,250}",
    "builtin:slack-webhook": r"https://hooks\.slack\.com/services/T[A-Z0-9]+/B[A-Z0-9]+/[A-Za-z0-9]{20,}",
    "builtin:gcp-api-key": r"\bAIza[0-9A-Za-z_-]{35}\b",
    "builtin:gcp-service-account-key": r"\"private_key_id\"\s*:\s*\"[0-9a-f]{40}\"",
    "builtin:stripe-secret-key": r"\b(?:sk|rk)_(?:live|test)_[0-9A-Za-z]{24,99}\b",
    "builtin:pem-private-key": r"-----BEGIN (?:[A-Z0-9]+ )?PRIVATE KEY(?: BLOCK)?-----",
}
