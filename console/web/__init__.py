"""The Console's web view: server-rendered pages over the same authorization and services as the
API (`/ui`). `mount` is the one call the application factory makes."""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from starlette.staticfiles import StaticFiles

from umbra.console.web.routes import router
from umbra.console.web.session import WebKeys


def mount(app: FastAPI) -> None:
    app.state.web_keys = WebKeys()
    app.include_router(router)
    static = resources.files("umbra.console.web") / "static"
    app.mount("/ui/static", StaticFiles(directory=str(static)), name="web_static")
