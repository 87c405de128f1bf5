"""The one error `umbra up`'s steps raise."""

from __future__ import annotations


class UpError(Exception):
    """One clear message (what and why) and the fix."""

    def __init__(self, message: str, fix: str = "") -> None:
        super().__init__(message)
        self.fix = fix
