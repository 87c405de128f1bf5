"""Redaction of traffic-log fields: secret values never reach a record.

The record itself is `umbra.contracts.traffic.TrafficRecord`, built in one place: the traffic-log
addon's `TrafficLog.emit` (`proxy/addons/traffic.py`), which the tunnel endpoint reports through too.
"""

from __future__ import annotations

import re

REDACTED = "[redacted]"


class Redactor:
    """Removes secret values (in any scanned encoding) from observed text before a record is built.

    Names are logged by design (hosts, paths, query keys), and a sandbox can put a secret in a
    name; the record must still never carry it.
    """

    def __init__(self, secrets: list[tuple[str, str]]) -> None:
        from umbra.proxy.scanner import MIN_SECRET_LENGTH, secret_encodings

        forms = sorted(
            {
                form.decode("utf-8", "replace")
                for _ref, value in secrets
                if len(value) >= MIN_SECRET_LENGTH
                for form in secret_encodings(value.encode())
            },
            key=len,
            reverse=True,
        )
        # One alternation, longest form first, so one pass replaces every form.
        self._pattern = re.compile("|".join(map(re.escape, forms))) if forms else None

    def clean(self, value: str) -> str:
        if self._pattern is None:
            return value
        return self._pattern.sub(REDACTED, value)
