"""`Content-Encoding: aws-chunked` (AWS SigV4 streaming uploads): the payload framed as chunks
`<hex size>[;chunk-signature=...]\\r\\n<data>\\r\\n`, ended by an empty chunk and optional trailer
lines. Undone for scanning like any other content encoding; a framing that does not parse
exactly is refused, never scanned in part."""

from __future__ import annotations

MAX_CHUNKS = 1 << 16


class AwsChunkedError(ValueError):
    pass


def unchunk(data: bytes | memoryview) -> bytes:
    """The chunks' data, then the trailer lines (scanned too), each trailer on its own line."""
    body = bytes(data)
    out = bytearray()
    position = 0
    for _ in range(MAX_CHUNKS):
        end = body.find(b"\r\n", position)
        if end < 0:
            raise AwsChunkedError("aws-chunked: a chunk header is not terminated")
        size_text = body[position:end].split(b";", 1)[0]
        if (
            not size_text
            or len(size_text) > 16
            or any(c not in b"0123456789abcdefABCDEF" for c in size_text)
        ):
            raise AwsChunkedError("aws-chunked: a chunk size does not parse")
        size = int(size_text, 16)
        start = end + 2
        if size == 0:
            trailers = body[start:]
            if trailers and not trailers.endswith(b"\r\n"):
                raise AwsChunkedError("aws-chunked: the trailer is not terminated")
            return bytes(out) + (b"\n" + trailers if trailers.strip() else b"")
        if start + size + 2 > len(body) or body[start + size : start + size + 2] != b"\r\n":
            raise AwsChunkedError("aws-chunked: a chunk is shorter than it says")
        out += body[start : start + size]
        position = start + size + 2
    raise AwsChunkedError("aws-chunked: too many chunks")
