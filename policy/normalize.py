"""Canonical forms of host names and request paths, shared by policy compilation and enforcement.

Both sides of a decision (the rule written by a reviewer, the request sent by a sandbox) pass through
these functions, so a name or path has exactly one spelling by the time it is compared. Anything with
more than one plausible reading is refused rather than guessed at: an attacker picks the reading the
policy did not consider.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from dataclasses import dataclass

import idna

MAX_HOST_LENGTH = 253
MAX_LABEL_LENGTH = 63
MAX_PATH_LENGTH = 8192

_LABEL = re.compile(r"^[a-z0-9_](?:[a-z0-9_-]*[a-z0-9_])?$")
# Labels that inet_aton-style parsers read as numbers (0x7f, 0177, 127): a name made only of these is
# an IPv4 address in disguise (127.1, 2130706433, 0x7f.0.0.1) and is refused, never resolved.
_NUMERIC_LABEL = re.compile(r"^(?:0x[0-9a-f]*|[0-9]+)$")
_UNRESERVED = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_PCHAR_RAW = _UNRESERVED | frozenset("!$&'()*+,;=:@")
_HEX = frozenset("0123456789abcdefABCDEF")
# Encoded bytes whose decoding changes how a path splits or terminates, in any server's reading.
_AMBIGUOUS_ENCODED = {"2F": "an encoded '/'", "5C": "an encoded '\\'", "00": "an encoded NUL"}
# The one encoded separator a request may carry (npm's `/@scope%2fname`), see `RequestPath`.
ENCODED_SLASH = "%2F"


class NormalizationError(ValueError):
    """A host or path that has no single canonical reading.

    The message says what is wrong, never quoting the input: it is sandbox- or caller-controlled
    and reaches denial bodies, the Console's 422 answers and logs (console.md, proxy.md)."""


@functools.lru_cache(maxsize=8192)  # pure, and hosts repeat on every request of a session
def normalize_host(raw: str) -> str:
    """Return the canonical form of a host name or IP literal.

    Lowercase, one trailing dot removed, internationalized names converted to their IDNA ASCII form,
    IP literals (IPv6 with or without brackets) rewritten in their compressed `ipaddress` form.
    """
    if not raw:
        raise NormalizationError("empty host")
    host = raw.strip()
    if host != raw:
        raise NormalizationError("host has surrounding white space")
    if host.startswith("[") or host.endswith("]"):
        if not (host.startswith("[") and host.endswith("]")):
            raise NormalizationError("host has unbalanced brackets")
        return _normalize_ipv6_literal(host[1:-1])
    if ":" in host:
        return _normalize_ipv6_literal(host)
    if host.endswith("."):
        host = host[:-1]
    if not host or host.endswith("."):
        raise NormalizationError("host has an empty label")
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        pass
    if not host.isascii():
        try:
            encoded = idna.encode(host, uts46=True).decode("ascii")
            round_trip = idna.decode(encoded)
        except idna.IDNAError:
            raise NormalizationError("host is not a valid internationalized name") from None
        # UTS 46 mapping silently drops or folds some characters (zero-width joiners, full-width
        # dots); a name that only reaches its ASCII form through such mapping has two spellings.
        if round_trip != host.lower():
            raise NormalizationError("host is not in canonical Unicode form")
        host = encoded
    host = host.lower()
    if len(host) > MAX_HOST_LENGTH:
        raise NormalizationError(f"host is longer than {MAX_HOST_LENGTH} characters")
    labels = host.split(".")
    for label in labels:
        if not label:
            raise NormalizationError("host has an empty label")
        if len(label) > MAX_LABEL_LENGTH:
            raise NormalizationError(f"a label of the host is longer than {MAX_LABEL_LENGTH}")
        if not _LABEL.match(label):
            raise NormalizationError("host has a character outside letters, digits, '-', '_'")
        if label.startswith("xn--"):
            _check_punycode_label(label)
    if all(_NUMERIC_LABEL.match(label) for label in labels):
        raise NormalizationError("host is a non-canonical IPv4 address form")
    if _NUMERIC_LABEL.match(labels[-1]):
        raise NormalizationError("host ends in a numeric label, which URL parsers read as IPv4")
    return host


def _normalize_ipv6_literal(text: str) -> str:
    if "%" in text:
        raise NormalizationError("host carries an IPv6 zone id")
    try:
        return str(ipaddress.IPv6Address(text))
    except ValueError:
        raise NormalizationError("host is not a valid IP literal") from None


def _check_punycode_label(label: str) -> None:
    # An xn-- label that does not decode, or decodes to something that would not encode back to
    # itself, is a second spelling of some other name.
    try:
        unicode = idna.decode(label)
        if idna.encode(unicode, uts46=True).decode("ascii") != label:
            raise NormalizationError("host has a non-canonical punycode label")
    except idna.IDNAError:
        raise NormalizationError("host has an invalid punycode label") from None


@functools.lru_cache(maxsize=8192)
def is_ip_literal(host: str) -> bool:
    """True when a normalized host is an IP address rather than a name."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def normalize_path(raw: str) -> str:
    """Return the canonical form of an origin-form path pattern (no query, no fragment).

    Percent-encodings of unreserved characters are decoded and all others upper-cased (RFC 3986
    6.2.2), then dot segments are removed (RFC 3986 5.2.4). Encoded separators, encoded or
    parameter-hidden dot segments, double encodings, empty segments, back-slashes, raw non-ASCII and
    control characters are refused: servers disagree on what they mean. Rules are written in this
    form; requests go through `normalize_request_path`, which admits one more spelling.
    """
    return _normalize(raw, encoded_slash=False)


@dataclass(frozen=True, slots=True)
class RequestPath:
    """A request path as the policy reads it.

    `canonical` is the logged form; an encoded slash stays in it as `%2F`. A server may read `%2F`
    as a separator (`/a%2Fb` is `/a/b`) or as a character of one segment (the resource `a/b`), so
    such a path has two readings: `segments` (split at every `%2F`: what every allow and deny rule
    is matched against) and `literal_segments` (`%2F` inside its segment; None when the path has no
    encoded slash: what deny rules are matched against too). Deny wins under either reading.
    """

    canonical: str
    segments: tuple[str, ...]
    literal_segments: tuple[str, ...] | None = None


def normalize_request_path(raw: str) -> RequestPath:
    """`normalize_path` for a request, which may also carry `%2F` inside a segment.

    Between two encoded slashes there must be a real name: never empty (`a%2F%2Fb`, `%2Fa`), never a
    dot segment (`a%2F..%2Fb`, also behind `;`), and a path with an encoded slash has no dot segment
    anywhere (removing `..` before or after decoding `%2F` gives different paths).
    """
    canonical = _normalize(raw, encoded_slash=True)
    literal = tuple(canonical[1:].split("/"))
    if ENCODED_SLASH not in raw.upper():
        return RequestPath(canonical, literal)
    # Checked on the request as sent: dot removal may already have dropped the encoded slash.
    if any(segment in {".", ".."} for segment in raw[1:].split("/")):
        raise NormalizationError("path has both an encoded '/' and a dot segment")
    split: list[str] = []
    for segment in literal:
        for piece in segment.split(ENCODED_SLASH) if ENCODED_SLASH in segment else [segment]:
            if segment != piece and (piece == "" or piece.split(";", 1)[0] in {".", ".."}):
                raise NormalizationError("path has an encoded '/' next to an empty or dot segment")
            split.append(piece)
    return RequestPath(canonical, tuple(split), literal)


def _normalize(raw: str, *, encoded_slash: bool) -> str:
    if not raw.startswith("/"):
        raise NormalizationError("path must start with '/'")
    if len(raw) > MAX_PATH_LENGTH:
        raise NormalizationError(f"path is longer than {MAX_PATH_LENGTH} characters")
    if "?" in raw or "#" in raw:
        raise NormalizationError("path must not contain a query or fragment")
    segments = [_normalize_segment(segment, encoded_slash) for segment in raw[1:].split("/")]
    for segment in segments[:-1]:
        if segment == "":
            raise NormalizationError("path has an empty segment ('//')")
    return _remove_dot_segments(segments)


def _normalize_segment(segment: str, encoded_slash: bool) -> str:
    out: list[str] = []
    i = 0
    while i < len(segment):
        char = segment[i]
        if char == "%":
            hex_digits = segment[i + 1 : i + 3]
            if len(hex_digits) != 2 or not set(hex_digits) <= _HEX:
                raise NormalizationError("path has a malformed percent-encoding")
            hex_digits = hex_digits.upper()
            if encoded_slash and hex_digits == "2F":
                out.append(ENCODED_SLASH)
                i += 3
                continue
            if hex_digits in _AMBIGUOUS_ENCODED:
                raise NormalizationError(f"path has {_AMBIGUOUS_ENCODED[hex_digits]}")
            if hex_digits == "25" and set(segment[i + 3 : i + 5]) <= _HEX and len(segment) >= i + 5:
                raise NormalizationError("path is double percent-encoded")
            decoded = chr(int(hex_digits, 16))
            out.append(decoded if decoded in _UNRESERVED else "%" + hex_digits)
            i += 3
            continue
        if char not in _PCHAR_RAW:
            raise NormalizationError(f"path has a character that must be percent-encoded: {char!r}")
        out.append(char)
        i += 1
    normalized = "".join(out)
    # '..;x' is '..' to servlet containers that strip path parameters.
    if normalized.split(";", 1)[0] in {".", ".."} and ";" in normalized:
        raise NormalizationError("path hides a dot segment behind ';' parameters")
    if normalized in {".", ".."} and normalized != segment:
        raise NormalizationError("path has a percent-encoded dot segment")
    return normalized


def _remove_dot_segments(segments: list[str]) -> str:
    output: list[str] = []
    for index, segment in enumerate(segments):
        last = index == len(segments) - 1
        if segment == ".":
            if last:
                output.append("")
        elif segment == "..":
            if output:
                output.pop()
            if last:
                output.append("")
        else:
            output.append(segment)
    return "/" + "/".join(output)
