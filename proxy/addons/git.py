"""Git push limits by ref: a push a `push_refs` rule allows may change only matching refs.

A git push over smart HTTP is a POST to `.../git-receive-pack` whose body starts with the command
list: pkt-lines `<old-oid> <new-oid> <ref>` (the first with `\\0capabilities`), optional `shallow`
lines, a flush (`0000`), then the packfile. For every POST allowed by a rule with `push_refs`, the
command list is parsed (after any Content-Encoding) and each ref it creates, updates or deletes
must match (`umbra.policy.decide_push`); the refs are recorded either way. A body that is not such
a command list (a push certificate, a truncated or lying pkt-line) is refused: the limit cannot be
checked, so nothing is forwarded.
"""

from __future__ import annotations

import re

from mitmproxy import http

from umbra.policy import Decision, decide_push
from umbra.proxy.addons.base import Denied, UmbraAddon, deny, guard
from umbra.proxy.addons.reasons import Reason
from umbra.proxy.addons.state import Stage, flow_state
from umbra.proxy.decode import DecodeError, DecodeLimit, content_decode

_OID = re.compile(rb"(?:[0-9a-f]{40}|[0-9a-f]{64})")
_MAX_COMMANDS = 4096


class PushError(ValueError):
    """A receive-pack request whose command list cannot be read."""


def push_commands(body: bytes) -> list[tuple[str, str]]:
    """(`create`/`update`/`delete`, ref) of each command of a receive-pack request."""
    commands: list[tuple[str, str]] = []
    position = 0
    while True:
        size_text = body[position : position + 4]
        if len(size_text) < 4:
            raise PushError("command list ends without a flush-pkt")
        try:
            size = int(size_text, 16)
        except ValueError:
            raise PushError("pkt-line length is not hexadecimal") from None
        if size == 0:
            break
        if size < 5 or position + size > len(body):
            raise PushError("pkt-line length does not match the body")
        line = body[position + 4 : position + size].split(b"\0", 1)[0].removesuffix(b"\n")
        position += size
        if line.startswith(b"shallow ") and _OID.fullmatch(line[8:]):
            continue
        parts = line.split(b" ")
        if len(parts) != 3 or not (_OID.fullmatch(parts[0]) and _OID.fullmatch(parts[1])):
            raise PushError("not a ref update command (push certificates are not supported)")
        ref = parts[2].decode("utf-8", "replace")
        if not ref.startswith("refs/") and ref != "HEAD":
            raise PushError("command names no ref")
        old_zero, new_zero = not parts[0].strip(b"0"), not parts[1].strip(b"0")
        commands.append(("create" if old_zero else "delete" if new_zero else "update", ref))
        if len(commands) > _MAX_COMMANDS:
            raise PushError(f"more than {_MAX_COMMANDS} commands")
    if not commands:
        raise PushError("no ref update command")
    return commands


class GitPush(UmbraAddon):
    @guard
    def request(self, flow: http.HTTPFlow) -> None:
        fstate = flow_state(flow)
        decision = fstate.decision
        if fstate.denied or fstate.stage is not Stage.GATED or decision is None:
            return
        if decision.push_refs is None or flow.request.method != "POST":
            return
        try:
            self.check(flow, decision)
        except Denied as denial:
            deny(self.shared, flow, denial)

    def check(self, flow: http.HTTPFlow, decision: Decision) -> None:
        fstate = flow_state(flow)
        request = flow.request
        body = request.raw_content or b""
        encoding = ",".join(request.headers.get_all("content-encoding"))
        try:
            decoded = content_decode(body, encoding, 4 * self.shared.max_body) if encoding else body
            commands = push_commands(decoded)
        except (DecodeError, DecodeLimit, PushError) as exc:
            raise Denied(Reason.MALFORMED_PUSH, str(exc), decision.rule_id) from None
        fstate.note = "push " + ", ".join(f"{kind} {ref}" for kind, ref in commands)
        verdict = decide_push(decision, [ref for _, ref in commands])
        if not verdict.allowed:
            raise Denied(Reason.PUSH_REF_DENIED, fstate.note, decision.rule_id)
