"""The Console's WEB_SESSION_KEY shape (base64 of 32 bytes), one check for the Console's setting,
the Console stack's `umbra:consoleWebSessionKey` and the launch agent reading it by reference."""

from __future__ import annotations

import base64
import binascii

WEB_SESSION_KEY_BYTES = 32


def decode_web_session_key(text: str) -> bytes:
    """The key's bytes; ValueError says what is wrong, never echoing the text."""
    try:
        raw = base64.b64decode(text, validate=True)
    except binascii.Error:
        raise ValueError("not valid base64") from None
    if len(raw) != WEB_SESSION_KEY_BYTES:
        raise ValueError(f"must be {WEB_SESSION_KEY_BYTES} bytes")
    return raw
