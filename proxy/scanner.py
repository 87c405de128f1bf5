"""One multi-pattern pass (Hyperscan) over every decoded layer of a request.

The database holds the policy's scan rules (built-in and profile), every encoding of every secret
value the proxy holds, and the sandbox-side placeholder pattern. A request is scanned as two
buffers, the request line plus headers and the body (with its Content-Encoding undone and its
multipart parts split out), each expanded by `decode.layers`.
"""

from __future__ import annotations

import base64
import json
import re
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from urllib.parse import quote

import hyperscan

from umbra.proxy.decode import Budget, DecodeError, DecodeLimit, layers, multipart_parts
from umbra.proxy.policy import CompiledScan
from umbra.proxy.secrets import PLACEHOLDER_PATTERN, SecretValue

MIN_SECRET_LENGTH = 8
_PLACEHOLDER_RE = re.compile(PLACEHOLDER_PATTERN.encode(), re.IGNORECASE)


class ScanError(Exception):
    """Content the scanner could not read within its bounds (the request is denied)."""

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        super().__init__(detail)


@dataclass
class ScanResult:
    rule_ids: set[str] = field(default_factory=set)
    placeholders: set[str] = field(default_factory=set)

    @property
    def clean(self) -> bool:
        return not self.rule_ids


def secret_encodings(value: bytes) -> set[bytes]:
    """The forms of a secret value worth matching literally, including base64 at every alignment."""
    forms = {value, value.hex().encode(), value.hex().upper().encode()}
    forms.add(quote(value, safe="").encode())
    forms.add(json.dumps(value.decode("utf-8", "replace"))[1:-1].encode())
    for offset in range(3):
        encoded = base64.b64encode(b"\0" * offset + value)
        start = -(-8 * offset // 6)
        end = (8 * (offset + len(value))) // 6
        piece = encoded[start:end]
        if len(piece) >= MIN_SECRET_LENGTH:
            forms.add(piece)
            forms.add(piece.replace(b"+", b"-").replace(b"/", b"_"))
    return {form for form in forms if len(form) >= MIN_SECRET_LENGTH}


def _literal(pattern: bytes) -> bytes:
    return b"".join(b"\\x%02x" % byte for byte in pattern)


class Scanner:
    """Compiled once per (policy, secret set); safe to use from several threads at once (each
    thread gets its own Hyperscan scratch space)."""

    def __init__(self, rules: Sequence[CompiledScan], secrets: Iterable[SecretValue]) -> None:
        expressions: list[bytes] = []
        labels: list[str] = []
        flags: list[int] = []
        regex_flags = hyperscan.HS_FLAG_SINGLEMATCH | hyperscan.HS_FLAG_DOTALL
        for rule in rules:
            expressions.append(rule.regex.encode())
            labels.append(rule.id)
            # No HS_FLAG_UTF8: bodies may be binary (protobuf, msgpack), and must still match.
            flags.append(regex_flags)
        for secret in secrets:
            if len(secret.value) < MIN_SECRET_LENGTH:
                continue
            for form in sorted(secret_encodings(secret.value.encode())):
                expressions.append(_literal(form))
                labels.append(f"secret:{secret.ref}")
                flags.append(regex_flags)
        self._placeholder_id = len(expressions)
        expressions.append(PLACEHOLDER_PATTERN.encode())
        labels.append("placeholder")
        flags.append(regex_flags | hyperscan.HS_FLAG_CASELESS)
        self._labels = labels
        self._db = hyperscan.Database(mode=hyperscan.HS_MODE_BLOCK)
        try:
            self._db.compile(
                expressions=expressions, ids=list(range(len(expressions))), flags=flags
            )
        except hyperscan.error as exc:
            raise ValueError(f"scan rules do not compile for Hyperscan: {exc}") from None
        self._prototype = hyperscan.Scratch(self._db)
        self._local = threading.local()

    @property
    def _scratch(self) -> hyperscan.Scratch:
        scratch = getattr(self._local, "scratch", None)
        if scratch is None:
            scratch = self._local.scratch = self._prototype.clone()
        return scratch

    def scan_buffers(self, buffers: Iterable[bytes], budget: Budget) -> ScanResult:
        result = ScanResult()
        matched: set[int] = set()

        def on_match(pattern_id: int, _start: int, _end: int, _flags: int, _ctx: object) -> None:
            matched.add(pattern_id)

        try:
            for buffer in buffers:
                for view in layers(buffer, budget):
                    before = self._placeholder_id in matched
                    self._db.scan(view, match_event_handler=on_match, scratch=self._scratch)
                    if self._placeholder_id in matched and not before:
                        result.placeholders.update(
                            match.group(1).decode("ascii").lower()
                            for match in _PLACEHOLDER_RE.finditer(view)
                        )
                        matched.discard(self._placeholder_id)
                    elif self._placeholder_id in matched:
                        matched.discard(self._placeholder_id)
        except DecodeLimit as exc:
            raise ScanError("scan_limit", str(exc)) from None
        except DecodeError as exc:
            raise ScanError("undecodable_content", str(exc)) from None
        result.rule_ids = {self._labels[index] for index in matched}
        return result

    def scan_request(
        self,
        head: bytes,
        body: bytes,
        content_type: str,
        limit: int,
        joined: bytes = b"",
    ) -> ScanResult:
        """Scan the request head (line, headers) and its already content-decoded body; `joined`
        (fields concatenated pairwise) is scanned for secrets only, not for placeholders."""
        budget = Budget(remaining=max(8 * (len(head) + len(body)), 1 << 20) + limit)
        buffers = [head]
        if body:
            buffers.append(body)
            if content_type.lower().startswith("multipart/"):
                try:
                    buffers.extend(multipart_parts(body, content_type, limit))
                except DecodeLimit as exc:
                    raise ScanError("scan_limit", str(exc)) from None
                except DecodeError as exc:
                    raise ScanError("undecodable_content", str(exc)) from None
        result = self.scan_buffers(buffers, budget)
        if joined:
            result.rule_ids |= self.scan_buffers([joined], budget).rule_ids
        return result

    def contains_any(self, data: bytes) -> set[str]:
        """Secret labels found verbatim (any encoding) in `data`, without layered decoding."""
        matched: set[int] = set()

        def on_match(pattern_id: int, _start: int, _end: int, _flags: int, _ctx: object) -> None:
            matched.add(pattern_id)

        self._db.scan(data, match_event_handler=on_match, scratch=self._scratch)
        return {self._labels[index] for index in matched if index != self._placeholder_id}
