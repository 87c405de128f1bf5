"""The Console's web view: server-rendered pages over the same authorization and services as the
API (`/ui`). `mount` is the one call the application factory makes."""

from __future__ import annotations

import base64
from importlib import resources

from fastapi import FastAPI
from starlette.staticfiles import StaticFiles

from umbra.console.web.routes import router
from umbra.console.web.session import WebKeys


def mount(app: FastAPI, session_key: str | None = None) -> None:
    """`session_key` (base64, the `web_session_key` setting) is shared by every worker and replica;
    without it the cookies are keyed at random per process."""
    app.state.web_keys = WebKeys(base64.b64decode(session_key) if session_key else None)
    app.include_router(router)
    static = resources.files("umbra.console.web") / "static"
    app.mount("/ui/static", StaticFiles(directory=str(static)), name="web_static")
