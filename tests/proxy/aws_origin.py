"""A local S3- and STS-style origin that verifies AWS Signature V4 with the **real** key, using
botocore's own signer (an implementation independent of `proxy/sigv4.py`), mounted as routes of a
test origin. It stores objects (PutObject, including `aws-chunked` bodies with an unsigned
trailer), serves them (GetObject), lists buckets, answers GetCallerIdentity, and refuses anything
whose signature does not verify (403 SignatureDoesNotMatch) or whose key is not the real one."""

from __future__ import annotations

import hashlib
import hmac
import threading
from datetime import UTC, datetime
from urllib.parse import parse_qsl, urlsplit

from botocore.auth import S3SigV4Auth, S3SigV4QueryAuth, SigV4Auth  # type: ignore[import-untyped]
from botocore.awsrequest import AWSRequest  # type: ignore[import-untyped]
from botocore.credentials import Credentials  # type: ignore[import-untyped]

from tests.proxy.harness import OriginHandler, Seen

XMLNS = 'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"'


class AwsOrigin:
    def __init__(self, access_key: str, secret_key: str, session_token: str | None = None) -> None:
        self.credentials = Credentials(access_key, secret_key, session_token)
        self.objects: dict[str, bytes] = {}
        self.verified = 0
        self.refused: list[str] = []
        self.seen_auth: list[str] = []
        self.lock = threading.Lock()

    # -- verification -------------------------------------------------------------------------
    def _verify(self, seen: Seen, scheme_host: str) -> str | None:
        """None when the signature verifies with the real key; else why not."""
        url = scheme_host + seen.path
        headers = {name.lower(): value for name, value in seen.headers}
        query = dict(parse_qsl(urlsplit(url).query, keep_blank_values=True))
        if "X-Amz-Signature" in query:
            return self._verify_presigned(seen, url, headers, query)
        auth = headers.get("authorization", "")
        self.seen_auth.append(auth)
        try:
            algorithm, rest = auth.split(" ", 1)
            fields = dict(part.strip().split("=", 1) for part in rest.split(","))
            access_key, date, region, service, _ = fields["Credential"].split("/")
        except (ValueError, KeyError):
            return "no parsable Authorization"
        if algorithm != "AWS4-HMAC-SHA256" or access_key != self.credentials.access_key:
            return f"not signed with the real key ({access_key[:24]})"
        if self.credentials.token and headers.get("x-amz-security-token") != self.credentials.token:
            return "wrong or missing session token"
        amz_date = headers.get("x-amz-date", "")
        if not self._fresh(amz_date) or amz_date[:8] != date:
            return "stale or mismatched date"
        signed = fields["SignedHeaders"].split(";")
        request = AWSRequest(
            method=seen.method,
            url=url,
            headers={name: headers[name] for name in signed if name in headers},
            data=seen.body,
        )
        request.context["timestamp"] = amz_date
        auth_class = S3SigV4Auth if service == "s3" else SigV4Auth
        signer = auth_class(self.credentials, service, region)
        canonical = signer.canonical_request(request)
        expected = signer.signature(signer.string_to_sign(request, canonical), request)
        if not hmac.compare_digest(expected, fields["Signature"]):
            return "SignatureDoesNotMatch"
        declared = headers.get("x-amz-content-sha256")
        if declared and len(declared) == 64 and declared != hashlib.sha256(seen.body).hexdigest():
            return "XAmzContentSHA256Mismatch"
        return None

    def _verify_presigned(
        self, seen: Seen, url: str, headers: dict[str, str], query: dict[str, str]
    ) -> str | None:
        access_key, date, region, service, _ = query["X-Amz-Credential"].split("/")
        if access_key != self.credentials.access_key:
            return "presigned with another key"
        amz_date = query["X-Amz-Date"]
        if not self._fresh(amz_date) or amz_date[:8] != date:
            return "stale presigned URL"
        parts = urlsplit(url)
        unsigned_query = "&".join(
            piece for piece in parts.query.split("&") if not piece.startswith("X-Amz-Signature=")
        )
        request = AWSRequest(
            method=seen.method,
            url=f"{parts.scheme}://{parts.netloc}{parts.path}?{unsigned_query}",
            headers={
                name: headers[name]
                for name in query["X-Amz-SignedHeaders"].split(";")
                if name in headers
            },
        )
        request.context["timestamp"] = amz_date
        signer = S3SigV4QueryAuth(self.credentials, service, region, expires=3600)
        canonical = signer.canonical_request(request)
        expected = signer.signature(signer.string_to_sign(request, canonical), request)
        if not hmac.compare_digest(expected, query["X-Amz-Signature"]):
            return "SignatureDoesNotMatch (presigned)"
        return None

    @staticmethod
    def _fresh(amz_date: str) -> bool:
        try:
            moment = datetime.strptime(amz_date, "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC)
        except ValueError:
            return False
        return abs((datetime.now(UTC) - moment).total_seconds()) < 900

    # -- routes -------------------------------------------------------------------------------
    def s3(self, handler: OriginHandler, seen: Seen) -> None:
        why = self._verify(seen, f"https://{seen.host}")
        if why is not None:
            with self.lock:
                self.refused.append(why)
            body = f"<Error><Code>SignatureDoesNotMatch</Code><Message>{why}</Message></Error>"
            handler.send(403, body.encode(), {"content-type": "application/xml"})
            return
        with self.lock:
            self.verified += 1
        key = urlsplit(seen.path).path
        if seen.method == "PUT":
            data = seen.body
            encoding = " ".join(seen.header("content-encoding"))
            if "aws-chunked" in encoding:
                data = _dechunk(data)
            with self.lock:
                self.objects[key] = data
            etag = hashlib.md5(data).hexdigest()  # noqa: S324 (S3's ETag)
            handler.send(200, b"", {"etag": f'"{etag}"'})
        elif seen.method == "GET" and key == "/":
            listing = (
                f'<?xml version="1.0" encoding="UTF-8"?><ListAllMyBucketsResult {XMLNS}>'
                "<Owner><ID>umbra</ID></Owner><Buckets><Bucket><Name>bucket</Name>"
                "<CreationDate>2026-01-01T00:00:00.000Z</CreationDate></Bucket></Buckets>"
                "</ListAllMyBucketsResult>"
            )
            handler.send(200, listing.encode(), {"content-type": "application/xml"})
        elif seen.method in ("GET", "HEAD") and key in self.objects:
            data = self.objects[key]
            etag = hashlib.md5(data).hexdigest()  # noqa: S324
            headers = {"etag": f'"{etag}"', "content-type": "application/octet-stream"}
            handler.send(200, data, headers | {"last-modified": "Thu, 01 Jan 2026 00:00:00 GMT"})
        else:
            body = "<Error><Code>NoSuchKey</Code><Message>no such key</Message></Error>"
            handler.send(404, body.encode(), {"content-type": "application/xml"})

    def sts(self, handler: OriginHandler, seen: Seen) -> None:
        why = self._verify(seen, f"https://{seen.host}")
        if why is not None:
            with self.lock:
                self.refused.append(why)
            error = (
                '<ErrorResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/"><Error>'
                f"<Type>Sender</Type><Code>SignatureDoesNotMatch</Code><Message>{why}</Message>"
                "</Error><RequestId>1</RequestId></ErrorResponse>"
            )
            handler.send(403, error.encode(), {"content-type": "text/xml"})
            return
        with self.lock:
            self.verified += 1
        answer = (
            '<GetCallerIdentityResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/">'
            "<GetCallerIdentityResult><Arn>arn:aws:iam::123456789012:user/umbra</Arn>"
            "<UserId>AIDAUMBRA</UserId><Account>123456789012</Account>"
            "</GetCallerIdentityResult><ResponseMetadata><RequestId>1</RequestId>"
            "</ResponseMetadata></GetCallerIdentityResponse>"
        )
        handler.send(200, answer.encode(), {"content-type": "text/xml"})


def _dechunk(body: bytes) -> bytes:
    """An aws-chunked body's data (chunk extensions and trailers dropped)."""
    out, position = bytearray(), 0
    while True:
        end = body.index(b"\r\n", position)
        size = int(body[position:end].split(b";")[0], 16)
        start = end + 2
        if size == 0:
            return bytes(out)
        out += body[start : start + size]
        position = start + size + 2
