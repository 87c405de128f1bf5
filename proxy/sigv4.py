"""AWS Signature Version 4, re-made on the Security CVM with the real key.

The sandbox holds placeholder keys (`AWS_ACCESS_KEY_ID=umbra-placeholder` or any value) and signs
its requests with them, as every AWS SDK and the AWS CLI do. For a host an `aws-sigv4` injection
binds, the proxy finds the request's signature (the `Authorization` header, or a presigned URL's
`X-Amz-*` query), checks the credential scope's service and region against the rule, and signs the
request again, as it is sent, with the secret's key: its own clock for the date, the secret's
session token (or none), the body's SHA-256 when the client sent one (the payload is buffered and
scanned anyway), `UNSIGNED-PAYLOAD` and `STREAMING-UNSIGNED-PAYLOAD-TRAILER` as sent, and the
chunk signatures of an `aws-chunked` `STREAMING-AWS4-HMAC-SHA256-PAYLOAD` body recomputed in
sequence. The real secret key never leaves this module; no placeholder signature reaches AWS.

Canonicalization follows the AWS documentation (and botocore): S3 paths are signed as sent, other
services' paths normalized (dot segments, repeated slashes) and URI-encoded once more; query names
and values decoded and encoded again with the unreserved set; header values trimmed and their inner
runs of spaces collapsed, repeated headers joined with commas.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from urllib.parse import quote, unquote

from mitmproxy.http import Headers

from umbra.contracts.secret_kinds import AwsSigv4

ALGORITHM = "AWS4-HMAC-SHA256"
UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"
STREAMING_SIGNED = "STREAMING-AWS4-HMAC-SHA256-PAYLOAD"
STREAMING_UNSIGNED_TRAILER = "STREAMING-UNSIGNED-PAYLOAD-TRAILER"
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
# Services whose canonical URI is the path as sent (no normalization, no second encoding).
S3_SERVICES = frozenset({"s3", "s3-object-lambda", "s3-outposts", "s3express"})
MAX_EXPIRES = 604800  # a presigned URL's longest life (7 days)
_AUTH = re.compile(
    r"^AWS4-HMAC-SHA256 +Credential=([^,\s]+), *SignedHeaders=([a-z0-9;_.-]+), *"
    r"Signature=[0-9a-f]{64}$"
)
_CHUNK = re.compile(rb"^([0-9a-fA-F]{1,16});chunk-signature=[0-9a-f]{64}$")


class Sigv4Error(Exception):
    """A request the proxy will not re-sign; `code` is the record's reason suffix."""

    def __init__(self, code: str, detail: str) -> None:
        self.code, self.detail = code, detail
        super().__init__(detail)


@dataclass(frozen=True)
class Scope:
    date: str  # YYYYMMDD
    region: str
    service: str

    def text(self) -> str:
        return f"{self.date}/{self.region}/{self.service}/aws4_request"


def parse_credential(credential: str) -> Scope:
    """`AKID/20260101/us-east-1/s3/aws4_request` (the access key id is the sandbox's: ignored)."""
    parts = credential.split("/")
    if len(parts) != 5 or parts[4] != "aws4_request" or not re.fullmatch(r"\d{8}", parts[1]):
        raise Sigv4Error("malformed", "the SigV4 credential scope does not parse")
    return Scope(parts[1], parts[2], parts[3])


def signing_key(secret: str, date: str, region: str, service: str) -> bytes:
    key = ("AWS4" + secret).encode()
    for part in (date, region, service, "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    return key


def _hmac_hex(key: bytes, text: str) -> str:
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def remove_dot_segments(path: str) -> str:
    """RFC 3986 §5.2.4 plus AWS's removal of empty segments (botocore's `remove_dot_segments`)."""
    if not path:
        return "/"
    output: list[str] = []
    for segment in path.split("/"):
        if segment in ("", "."):
            continue
        if segment == "..":
            if output:
                output.pop()
        else:
            output.append(segment)
    first = "/" if path.startswith("/") else ""
    last = "/" if path.endswith("/") and output else ""
    return first + "/".join(output) + last


def canonical_uri(raw_path: str, service: str) -> str:
    if service in S3_SERVICES:
        return raw_path or "/"
    return quote(remove_dot_segments(raw_path), safe="/~")


def _encode(text: str) -> str:
    return quote(text, safe="-_.~")


def query_pairs(query: str) -> list[tuple[str, str]]:
    """Decoded (name, value) pairs of a raw query, in order (`+` is a literal plus)."""
    pairs = []
    for piece in query.split("&"):
        if piece:
            name, _, value = piece.partition("=")
            pairs.append((unquote(name), unquote(value)))
    return pairs


def canonical_query(pairs: list[tuple[str, str]]) -> str:
    return "&".join(f"{k}={v}" for k, v in sorted((_encode(k), _encode(v)) for k, v in pairs))


def _check_scope(scope: Scope, services: list[str], regions: list[str]) -> None:
    if scope.service not in services or scope.region not in regions:
        raise Sigv4Error(
            "scope_refused",
            f"SigV4 scope {scope.service}/{scope.region} is not one this rule signs "
            f"(services {', '.join(services)}; regions {', '.join(regions)})",
        )


@dataclass
class Resigned:
    path: str  # the request target to send (a presigned query re-made)
    body: bytes | None  # a re-chunked aws-chunked body, else None (unchanged)
    placed: list[str]  # values placed on the wire that must not be echoed (a session token)


def resign(
    *,
    method: str,
    path: str,
    host: str,
    headers: Headers,
    body: bytes,
    secret: AwsSigv4,
    services: list[str],
    regions: list[str],
    now: datetime | None = None,
) -> Resigned:
    """Sign the request again with `secret`, in whichever form the sandbox signed it; `headers`
    is changed in place. Raises Sigv4Error (`missing`, `malformed`, `scope_refused`,
    `unsupported`) for a request that is not re-signed."""
    moment = (now or datetime.now(UTC)).astimezone(UTC)
    amz_date = moment.strftime("%Y%m%dT%H%M%SZ")
    raw_path, _, query = path.partition("?")
    pairs = query_pairs(query)
    authorizations = headers.get_all("authorization")
    presigned = any(name == "X-Amz-Algorithm" for name, _ in pairs)
    if authorizations and presigned:
        raise Sigv4Error("malformed", "a request signed both in a header and in its query")
    if presigned:
        return _resign_query(method, raw_path, pairs, host, headers, body, secret, services,
                             regions, amz_date)  # fmt: skip
    if not authorizations:
        raise Sigv4Error("missing", "the request carries no AWS signature to re-make")
    if len(authorizations) != 1:
        raise Sigv4Error("malformed", "more than one Authorization header")
    if not authorizations[0].startswith(ALGORITHM + " "):
        raise Sigv4Error("unsupported", "only AWS4-HMAC-SHA256 signatures are re-made")
    match = _AUTH.match(authorizations[0])
    if match is None:
        raise Sigv4Error("malformed", "the SigV4 Authorization header does not parse")
    client_scope = parse_credential(match.group(1))
    _check_scope(client_scope, services, regions)
    scope = Scope(amz_date[:8], client_scope.region, client_scope.service)
    key = signing_key(secret.secret_access_key, scope.date, scope.region, scope.service)

    del headers["authorization"]
    headers["X-Amz-Date"] = amz_date
    _place_token(headers, secret)
    declared = headers.get("x-amz-content-sha256")
    new_body: bytes | None = None
    if declared in (UNSIGNED_PAYLOAD, STREAMING_UNSIGNED_TRAILER, STREAMING_SIGNED):
        payload = declared
    elif declared is not None and declared.startswith("STREAMING-"):
        raise Sigv4Error("unsupported", f"payload mode {declared[:60]} is not re-signed")
    else:
        payload = hashlib.sha256(body).hexdigest()
        if declared is not None:
            headers["X-Amz-Content-SHA256"] = payload
    signed = _signed_headers(match.group(2).split(";"), headers, secret)
    canonical = "\n".join(
        [
            method,
            canonical_uri(raw_path, scope.service),
            canonical_query(pairs),
            _canonical_headers(signed, host, headers) + "\n",
            ";".join(signed),
            payload,
        ]
    )
    signature = _hmac_hex(key, _string_to_sign(amz_date, scope, canonical))
    headers["Authorization"] = (
        f"{ALGORITHM} Credential={secret.access_key_id}/{scope.text()}, "
        f"SignedHeaders={';'.join(signed)}, Signature={signature}"
    )
    if declared == STREAMING_SIGNED:
        new_body = rechunk(body, key, amz_date, scope, signature)
    return Resigned(path, new_body, [secret.session_token] if secret.session_token else [])


def _resign_query(
    method: str,
    raw_path: str,
    pairs: list[tuple[str, str]],
    host: str,
    headers: Headers,
    body: bytes,
    secret: AwsSigv4,
    services: list[str],
    regions: list[str],
    amz_date: str,
) -> Resigned:
    found: dict[str, str] = {}
    for name, value in pairs:
        if name.startswith("X-Amz-"):
            if name in found:
                raise Sigv4Error("malformed", f"{name} is given twice")
            found[name] = value
    if found.get("X-Amz-Algorithm") != ALGORITHM:
        raise Sigv4Error("unsupported", "only AWS4-HMAC-SHA256 presigned URLs are re-made")
    client_scope = parse_credential(found.get("X-Amz-Credential", ""))
    _check_scope(client_scope, services, regions)
    expires = found.get("X-Amz-Expires", "")
    if not expires.isdigit() or not 1 <= int(expires) <= MAX_EXPIRES:
        raise Sigv4Error("malformed", "X-Amz-Expires must be 1 to 604800 seconds")
    signed_names = found.get("X-Amz-SignedHeaders", "")
    if not re.fullmatch(r"[a-z0-9;_.-]+", signed_names):
        raise Sigv4Error("malformed", "X-Amz-SignedHeaders does not parse")
    scope = Scope(amz_date[:8], client_scope.region, client_scope.service)
    replaced = {"X-Amz-Credential", "X-Amz-Date", "X-Amz-Security-Token", "X-Amz-Signature"}
    kept = [(name, value) for name, value in pairs if name not in replaced]
    kept += [
        ("X-Amz-Credential", f"{secret.access_key_id}/{scope.text()}"),
        ("X-Amz-Date", amz_date),
    ]
    if secret.session_token:
        kept.append(("X-Amz-Security-Token", secret.session_token))
    # Headers signed in a presigned URL are the client's choice minus the token header (the
    # token travels in the query here).
    signed = _signed_headers(signed_names.split(";"), headers, None, require_date=False)
    kept = [(n, ";".join(signed) if n == "X-Amz-SignedHeaders" else v) for n, v in kept]
    payload = UNSIGNED_PAYLOAD if scope.service in S3_SERVICES else hashlib.sha256(body).hexdigest()
    canonical = "\n".join(
        [
            method,
            canonical_uri(raw_path, scope.service),
            canonical_query(kept),
            _canonical_headers(signed, host, headers) + "\n",
            ";".join(signed),
            payload,
        ]
    )
    key = signing_key(secret.secret_access_key, scope.date, scope.region, scope.service)
    signature = _hmac_hex(key, _string_to_sign(amz_date, scope, canonical))
    query = canonical_query(kept) + f"&X-Amz-Signature={signature}"
    placed = [secret.session_token, _encode(secret.session_token)] if secret.session_token else []
    return Resigned(f"{raw_path}?{query}", None, placed)


def _place_token(headers: Headers, secret: AwsSigv4) -> None:
    while "x-amz-security-token" in headers:
        del headers["x-amz-security-token"]
    if secret.session_token:
        headers["X-Amz-Security-Token"] = secret.session_token


def _signed_headers(
    client: list[str], headers: Headers, secret: AwsSigv4 | None, *, require_date: bool = True
) -> list[str]:
    names = {name for name in client if name}
    names.discard("x-amz-security-token")
    names.add("host")
    if require_date:
        names.add("x-amz-date")
    if secret is not None and secret.session_token:
        names.add("x-amz-security-token")
    if "x-amz-content-sha256" in headers:
        names.add("x-amz-content-sha256")
    missing = sorted(name for name in names if name != "host" and name not in headers)
    if missing:
        raise Sigv4Error("malformed", f"signed header(s) not in the request: {', '.join(missing)}")
    return sorted(names)


def _canonical_headers(names: list[str], host: str, headers: Headers) -> str:
    lines = []
    for name in names:
        values = [host] if name == "host" else headers.get_all(name)
        lines.append(f"{name}:{','.join(' '.join(value.split()) for value in values)}")
    return "\n".join(lines)


def _string_to_sign(amz_date: str, scope: Scope, canonical: str) -> str:
    digest = hashlib.sha256(canonical.encode()).hexdigest()
    return f"{ALGORITHM}\n{amz_date}\n{scope.text()}\n{digest}"


def chunk_string_to_sign(amz_date: str, scope: Scope, previous: str, data: bytes) -> str:
    return (
        f"{ALGORITHM}-PAYLOAD\n{amz_date}\n{scope.text()}\n{previous}\n{EMPTY_SHA256}\n"
        + hashlib.sha256(data).hexdigest()
    )


def rechunk(body: bytes, key: bytes, amz_date: str, scope: Scope, seed: str) -> bytes:
    """An `aws-chunked` body with every chunk signature made again, chained from `seed` (the
    request's new signature); the framing must parse exactly, through the final empty chunk."""
    out = bytearray()
    previous, position = seed, 0
    while True:
        end = body.find(b"\r\n", position)
        if end < 0:
            raise Sigv4Error("malformed", "an aws-chunked body ends inside a chunk header")
        match = _CHUNK.match(body[position:end])
        if match is None:
            raise Sigv4Error("malformed", "an aws-chunked chunk header does not parse")
        size = int(match.group(1), 16)
        start = end + 2
        data = body[start : start + size]
        if len(data) != size or body[start + size : start + size + 2] != b"\r\n":
            raise Sigv4Error("malformed", "an aws-chunked chunk is shorter than it says")
        previous = _hmac_hex(key, chunk_string_to_sign(amz_date, scope, previous, data))
        out += match.group(1) + b";chunk-signature=" + previous.encode() + b"\r\n" + data + b"\r\n"
        position = start + size + 2
        if size == 0:
            if position != len(body):
                raise Sigv4Error("unsupported", "trailers after a signed aws-chunked body")
            return bytes(out)
