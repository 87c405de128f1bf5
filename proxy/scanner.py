"""One multi-pattern pass (Hyperscan) over every decoded layer of a request.

The database holds the policy's scan rules (built-in and profile), every encoding of every secret
value the proxy holds, and the sandbox-side placeholder pattern. A request is scanned as two
buffers, the request line plus headers and the body (with its Content-Encoding undone and its
multipart parts split out), each expanded level by level (`decode.decode_level`), one Hyperscan
pass per level.
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from urllib.parse import quote

import hyperscan

from umbra.policy import CompiledScan
from umbra.proxy.containers import Limits, Malformed, expand, grpc_messages
from umbra.proxy.decode import (
    DENSE,
    MAX_DEPTH,
    RUN_EXPRESSION,
    RUN_LENGTH,
    TRIGGERS,
    WINDOWED,
    Budget,
    DecodeError,
    DecodeLimit,
    Found,
    Trigger,
    decode_level,
    dense_runs,
    multipart_parts,
    run_end,
)
from umbra.proxy.secrets import PLACEHOLDER_PATTERN, SecretValue

MIN_SECRET_LENGTH = 8
# Past this many base64 runs in a buffer, the rest is searched by translate + find instead.
_SPARSE_RUNS = 64
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


def _compile(expressions: list[bytes], ids: list[int], flags: list[int]) -> hyperscan.Database:
    database = hyperscan.Database(mode=hyperscan.HS_MODE_BLOCK)
    database.compile(expressions=expressions, ids=ids, flags=flags)
    return database


class Scanner:
    """Compiled once per (policy, secret set); safe to use from several threads at once (each
    thread gets its own Hyperscan scratch space).

    One database holds the rules, the secrets' forms, the placeholder pattern and the decoding
    triggers (`decode.TRIGGERS`), so each level of a buffer costs one Hyperscan pass: detections
    and the offsets to decode from come out of the same scan, and each level of decodings is one
    buffer again. A twin database reports the windowed triggers only once (for dense buffers)."""

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
        self._trigger_base = len(expressions)
        ids = list(range(len(expressions) + len(TRIGGERS)))
        triggers = [TRIGGERS[kind] for kind in Trigger]
        every = [0] * len(TRIGGERS)
        once = [hyperscan.HS_FLAG_SINGLEMATCH if kind in WINDOWED else 0 for kind in Trigger]
        try:
            self._db = _compile(expressions + triggers, ids, flags + every)
            self._dense_db = _compile(expressions + triggers, ids, flags + once)
        except hyperscan.error as exc:
            raise ValueError(f"scan rules do not compile for Hyperscan: {exc}") from None
        self._run_db = _compile([RUN_EXPRESSION], [0], [0])
        self._prototypes = (
            hyperscan.Scratch(self._db),
            hyperscan.Scratch(self._dense_db),
            hyperscan.Scratch(self._run_db),
        )
        self._local = threading.local()

    def _scratches(self) -> list[hyperscan.Scratch]:
        scratches: list[hyperscan.Scratch] | None = getattr(self._local, "scratches", None)
        if scratches is None:
            scratches = [prototype.clone() for prototype in self._prototypes]
            self._local.scratches = scratches
        return scratches

    def _runs(self, data: bytes, scratch: hyperscan.Scratch) -> list[tuple[int, int]]:
        """(start, end) of each base64 run: stop at a run, find its end, resume after it."""
        runs: list[tuple[int, int]] = []
        view = memoryview(data)
        position = 0
        hit = [-1]

        def on_run(_id: int, _start: int, end: int, _flags: int, _ctx: object) -> bool:
            hit[0] = end
            return True

        while position < len(data):
            if len(runs) >= _SPARSE_RUNS:
                return runs + dense_runs(data, position)
            hit[0] = -1
            with contextlib.suppress(hyperscan.ScanTerminated):
                self._run_db.scan(
                    view[position:],  # type: ignore[type-var]  # any buffer; no copy
                    match_event_handler=on_run,
                    scratch=scratch,
                )
            if hit[0] < 0:
                break
            start = position + hit[0] - RUN_LENGTH
            position = run_end(data, position + hit[0])
            runs.append((start, position))
        return runs

    def _level(self, data: bytes, matched: set[int], result: ScanResult) -> Found:
        """One Hyperscan pass: detections into `matched`, decoding triggers into the result."""
        found = Found()
        offsets = found.offsets
        base = self._trigger_base
        windowed_last = base + max(WINDOWED)
        dense = DENSE
        hits: set[int] = set()

        def on_match(pattern_id: int, _start: int, end: int, _flags: int, _ctx: object) -> bool:
            if pattern_id < base:
                hits.add(pattern_id)
                return False
            kind = offsets[pattern_id - base]
            kind.append(end)
            # Too many windows of one kind: stop, and rescan reporting that kind only once.
            return pattern_id <= windowed_last and len(kind) > dense

        scratch, dense_scratch, run_scratch = self._scratches()
        try:
            self._db.scan(data, match_event_handler=on_match, scratch=scratch)
        except hyperscan.ScanTerminated:
            found = Found(dense=True)
            offsets = found.offsets
            hits.clear()
            dense = 1 << 62
            self._dense_db.scan(data, match_event_handler=on_match, scratch=dense_scratch)
        found.present = {kind for kind in Trigger if offsets[kind]}
        found.runs = self._runs(data, run_scratch)
        if self._placeholder_id in hits:
            hits.discard(self._placeholder_id)
            result.placeholders.update(
                match.group(1).decode("ascii").lower() for match in _PLACEHOLDER_RE.finditer(data)
            )
        matched |= hits
        return found

    def scan_buffers(self, buffers: Iterable[bytes], limits: Limits) -> ScanResult:
        """Each buffer scanned level by level until nothing is left to decode; content still
        encoded after MAX_DEPTH levels, or decoding past the request's budget (bytes, time), is
        refused (`scan_limit`), never passed with its lowest layer unscanned."""
        result = ScanResult()
        matched: set[int] = set()
        try:
            for buffer in buffers:
                level = buffer
                for depth in range(MAX_DEPTH + 1):
                    found = self._level(level, matched, result)
                    if not (found.present or found.runs):
                        break
                    if depth == MAX_DEPTH:
                        raise DecodeLimit(
                            f"content still encoded after {MAX_DEPTH} decoding levels"
                        )
                    limits.check_time()
                    level = decode_level(level, found, limits.budget, depth)
                    if not level:
                        break
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
        grpc_encoding: str = "",
    ) -> ScanResult:
        """Scan the request head (line, headers) and its already content-decoded body; `joined`
        (fields concatenated pairwise) is scanned for secrets only, not for placeholders. What
        the body holds without saying so (archives, packfiles, compressed streams, gRPC messages,
        wide text, character references: `containers.expand`) is scanned as more buffers, all
        under the one budget."""
        budget = Budget(remaining=max(8 * (len(head) + len(body)), 1 << 20) + limit)
        limits = Limits(budget)
        buffers = [head]
        if body:
            buffers.append(body)
            try:
                if content_type.lower().startswith("multipart/"):
                    buffers.extend(multipart_parts(body, content_type, limit))
                if content_type.lower().startswith("application/grpc"):
                    buffers.extend(grpc_messages(body, grpc_encoding, limits))
                for item in buffers[1:]:
                    buffers.extend(expand(item, limits))
            except DecodeLimit as exc:
                raise ScanError("scan_limit", str(exc)) from None
            except DecodeError as exc:
                raise ScanError("undecodable_content", str(exc)) from None
            except Malformed as exc:
                raise ScanError(str(exc.reason), str(exc)) from None
        result = self.scan_buffers(buffers, limits)
        if joined:
            result.rule_ids |= self.scan_buffers([joined], limits).rule_ids
        return result
