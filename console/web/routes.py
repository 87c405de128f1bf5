"""The web view's pages and forms (`/ui`). Handlers parse input and delegate to the services the
API uses (`console/services/`: traffic and CVM lists, writes through `actions`) and to `queries`
(the web view's own reads); errors become HTML pages, never tracebacks."""

from __future__ import annotations

import re
from collections.abc import Callable, Coroutine
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qs, urlencode

from fastapi import APIRouter, HTTPException, Request, status
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool

from umbra.console.enums import Role
from umbra.console.longpoll import long_poll
from umbra.console.routes.errors import status_of
from umbra.console.schemas import NAME_PATTERN
from umbra.console.services import traffic as traffic_service
from umbra.console.services import usage as usage_service
from umbra.console.services.access import User
from umbra.console.services.errors import ServiceError
from umbra.console.services.people import active_roles
from umbra.console.state import Console
from umbra.console.web import actions, login, queries
from umbra.console.web.filters import RANGE_CHOICES, FilterError, parse_filters
from umbra.console.web.queries import PAGE_SIZE
from umbra.console.web.render import render, visible
from umbra.console.web.session import (
    MAX_SESSION_SECONDS,
    WebKeys,
    WebSession,
    clear_cookie,
    cookie_names,
    csrf_ok,
    set_cookie,
)

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}
_TEAM = re.compile(NAME_PATTERN)
_LOCAL_PATH = re.compile(r"^/ui(?:/[A-Za-z0-9._~%/=&+-]*)?(?:\?[A-Za-z0-9._~%/=&+-]*)?$")
MAX_FORM_BYTES = 64 << 10
LIVE_WAIT_SECONDS = 15.0


class LoginRequired(Exception):
    """No valid session: send the browser to the login page."""


class WebRoute(APIRoute):
    """Every /ui response carries the security headers; HTTP errors render as an HTML page."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def wrapped(request: Request) -> Response:
            try:
                response = await handler(request)
            except LoginRequired:
                target = request.url.path if request.method == "GET" else "/ui/"
                if request.url.query and request.method == "GET":
                    target += "?" + request.url.query
                response = RedirectResponse(
                    "/ui/login?" + urlencode({"next": target}), status.HTTP_303_SEE_OTHER
                )
            except HTTPException as exc:
                response = error_page(request, exc.status_code, str(exc.detail))
            except ServiceError as exc:
                response = error_page(request, status_of(exc), exc.detail)
            except FilterError as exc:
                response = error_page(request, 422, str(exc))
            response.headers.update(SECURITY_HEADERS)
            return response

        return wrapped


router = APIRouter(prefix="/ui", route_class=WebRoute, include_in_schema=False)


def _console(request: Request) -> Console:
    console: Console = request.app.state.console
    return console


def _keys(request: Request) -> WebKeys:
    keys: WebKeys = request.app.state.web_keys
    return keys


def _session(request: Request) -> WebSession:
    name, _ = cookie_names(request)
    session = _keys(request).open_session(request.cookies.get(name))
    if session is None:
        raise LoginRequired
    # A session cookie outlives a deactivation; its roles do not (services/people.py).
    roles = active_roles(_console(request), session.subject, session.roles)
    return session if roles == session.roles else replace(session, roles=roles)


def error_page(request: Request, code: int, message: str) -> HTMLResponse:
    name, _ = cookie_names(request)
    session = _keys(request).open_session(request.cookies.get(name))
    body = render("error.html", code=code, message=message, session=session, team=None, nav="")
    return HTMLResponse(body, status_code=code)


def _team(team: str) -> str:
    if len(team) > 64 or not _TEAM.match(team):
        raise HTTPException(status.HTTP_404_NOT_FOUND, "team not found")
    return team


def _page(
    request: Request, session: WebSession, team: str | None, nav: str, name: str, **context: Any
) -> HTMLResponse:
    flash = request.query_params.get("done")
    body = render(
        name,
        session=session,
        team=team,
        nav=nav,
        flash=flash[:300] if flash else None,
        is_admin=team is not None and session.roles.get(team) == Role.admin,
        **context,
    )
    return HTMLResponse(body)


# -- login ------------------------------------------------------------------------------------
def _callback_url(request: Request) -> str:
    return str(request.url_for("web_callback"))


@router.get("/login", name="web_login")
def login_page(request: Request) -> Response:
    next_path = request.query_params.get("next", "/ui/")
    if len(next_path) > 2048 or not _LOCAL_PATH.match(next_path):
        next_path = "/ui/"
    try:
        started = login.start(_console(request), _callback_url(request))
    except login.LoginError as exc:
        return error_page(request, status.HTTP_503_SERVICE_UNAVAILABLE, str(exc))
    response = RedirectResponse(started.url, status.HTTP_303_SEE_OTHER)
    _, login_cookie = cookie_names(request)
    value = _keys(request).seal_login(started.state, started.verifier, next_path)
    set_cookie(request, response, login_cookie, value, 600)
    return response


@router.get("/callback", name="web_callback")
def callback(request: Request) -> Response:
    _, login_cookie = cookie_names(request)
    pending = _keys(request).open_login(request.cookies.get(login_cookie))
    params = request.query_params
    if pending is None:
        return error_page(request, 400, "this login has expired or was started elsewhere")
    if "error" in params:
        return error_page(request, 401, f"the identity provider refused: {params['error'][:100]}")
    state, code = params.get("state", ""), params.get("code", "")
    if not state or state != pending["st"] or not code or len(code) > 4096:
        return error_page(request, 400, "the login's state does not match; start again")
    try:
        session = login.finish(_console(request), code, pending["v"], _callback_url(request))
    except login.LoginError as exc:
        return error_page(request, 401, str(exc))
    response = RedirectResponse(pending["n"], status.HTTP_303_SEE_OTHER)
    session_cookie, _ = cookie_names(request)
    seconds = max(0, min(MAX_SESSION_SECONDS, session.expires - int(datetime.now(UTC).timestamp())))
    set_cookie(request, response, session_cookie, _keys(request).seal_session(session), seconds)
    clear_cookie(request, response, login_cookie)
    return response


async def _form(request: Request, session: WebSession) -> dict[str, str]:
    """A urlencoded form, CSRF-checked (token and, when sent, Origin)."""
    origin = request.headers.get("origin")
    if origin is not None and origin != f"{request.url.scheme}://{request.url.netloc}":
        raise HTTPException(status.HTTP_403_FORBIDDEN, "cross-origin form refused")
    raw = await request.body()
    if len(raw) > MAX_FORM_BYTES:
        raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, "form too large")
    try:
        parsed = parse_qs(raw.decode("utf-8"), keep_blank_values=True, max_num_fields=100)
    except (UnicodeDecodeError, ValueError):
        raise HTTPException(status.HTTP_400_BAD_REQUEST, "form is not valid") from None
    form = {key: values[-1] for key, values in parsed.items()}
    if not csrf_ok(session, form.get("csrf")):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "the form's CSRF token is missing or stale")
    return form


@router.post("/logout")
async def logout(request: Request) -> Response:
    session = _session(request)
    await _form(request, session)
    response = HTMLResponse(render("logged_out.html", session=None, team=None, nav=""))
    session_cookie, _ = cookie_names(request)
    clear_cookie(request, response, session_cookie)
    return response


# -- pages ------------------------------------------------------------------------------------
@router.get("/", name="web_home")
def home(request: Request) -> Response:
    session = _session(request)
    teams = sorted(session.roles)
    if not teams:
        return _page(request, session, None, "", "no_team.html")
    return RedirectResponse(f"/ui/teams/{teams[0]}/traffic", status.HTTP_303_SEE_OTHER)


def _cvm_names(console: Console, user: User, team: str) -> dict[str, str]:
    return {view.cvm.id: view.cvm.name for view in queries.cvm_list(console, user, team, True)}


@router.get("/teams/{team}/traffic")
def traffic(request: Request, team: str) -> Response:
    session = _session(request)
    team = _team(team)
    console = _console(request)
    raw = dict(request.query_params)
    filters = traffic_service.scoped(session.user, team, parse_filters(raw))
    page = traffic_service.page(console=console, team=team, filters=filters, limit=PAGE_SIZE)
    first = page.rows[0] if page.rows and filters.cursor is None else None
    newest = traffic_service.encode_cursor(first) if first is not None else None
    return _page(
        request,
        session,
        team,
        "traffic",
        "traffic.html",
        filters=filters,
        raw={k: v[:300] for k, v in raw.items()},
        page=page,
        names=_cvm_names(console, session.user, team),
        ranges=RANGE_CHOICES,
        newest=newest,
        live_query=urlencode(filters.query(cursor=None, since=None, until=None, range=None)),
    )


@router.get("/teams/{team}/traffic/live")
async def traffic_live(request: Request, team: str) -> Response:
    session = _session(request)
    team = _team(team)
    console = _console(request)
    params = dict(request.query_params)
    after = params.pop("after", None)
    filters = traffic_service.scoped(session.user, team, parse_filters(params))
    if after is not None and (len(after) > 512 or not re.match(r"^[A-Za-z0-9_-]+$", after)):
        raise HTTPException(422, "after: not a cursor this page produced")
    rows = await long_poll(
        console,
        lambda: traffic_service.newer(console=console, team=team, filters=filters, after=after),
        lambda found: not found,
        LIVE_WAIT_SECONDS if after is not None else 0,
    )
    names = await run_in_threadpool(_cvm_names, console, session.user, team)
    records = [
        {
            "id": row.id,
            "url": f"/ui/teams/{team}/records/{row.id}",
            "time": row.time.strftime("%Y-%m-%d %H:%M:%S"),
            "cvm": visible(names.get(row.cvm_id or "", row.cvm_id or "")),
            "owner": visible(row.owner or ""),
            "method": visible(row.method or ""),
            "host": visible(row.host or row.connect_host or ""),
            "path": visible((row.path or "")[:120]),
            "decision": row.decision,
            "reason": visible(row.reason or ""),
            "rule": visible(row.rule_id or ""),
            "status": "" if row.status is None else str(row.status),
        }
        for row in rows
    ]
    cursor = traffic_service.encode_cursor(rows[-1]) if rows else after
    return JSONResponse({"records": records, "cursor": cursor})


@router.get("/teams/{team}/records/{record_id}")
def record(request: Request, team: str, record_id: str) -> Response:
    session = _session(request)
    team = _team(team)
    console = _console(request)
    row = traffic_service.record(
        console=console, user=session.user, team=team, record_id=record_id[:64]
    )
    return _page(
        request,
        session,
        team,
        "traffic",
        "record.html",
        record=row,
        names=_cvm_names(console, session.user, team),
    )


@router.get("/teams/{team}/overview")
def overview(request: Request, team: str) -> Response:
    session = _session(request)
    team = _team(team)
    choice = request.query_params.get("range", "24h")
    seconds = {"1h": 3600, "6h": 21600, "24h": 86400, "7d": 604800, "30d": 2592000}.get(choice)
    if seconds is None:
        raise FilterError("range: one of 1h, 6h, 24h, 7d, 30d")
    data = queries.overview(_console(request), session.user, team, seconds)
    return _page(
        request,
        session,
        team,
        "overview",
        "overview.html",
        data=data,
        selected=choice,
        names=_cvm_names(_console(request), session.user, team),
    )


@router.get("/teams/{team}/cvms")
def cvms(request: Request, team: str) -> Response:
    session = _session(request)
    team = _team(team)
    include = request.query_params.get("destroyed") == "1"
    views = queries.cvm_list(_console(request), session.user, team, include)
    names = {view.cvm.id: view.cvm.name for view in views}
    return _page(
        request, session, team, "cvms", "cvms.html", views=views, names=names, include=include
    )


@router.get("/teams/{team}/cvms/{cvm_id}")
def cvm(request: Request, team: str, cvm_id: str) -> Response:
    session = _session(request)
    team = _team(team)
    console = _console(request)
    view = queries.cvm_detail(console, session.user, team, cvm_id[:64])
    return _page(
        request,
        session,
        team,
        "cvms",
        "cvm.html",
        view=view,
        available=queries.bundle_profiles(console, team),
        names=_cvm_names(console, session.user, team),
    )


@router.post("/teams/{team}/cvms/{cvm_id}/actions")
async def cvm_action(request: Request, team: str, cvm_id: str) -> Response:
    session = _session(request)
    team = _team(team)
    form = await _form(request, session)
    console, user, cvm_id = _console(request), session.user, cvm_id[:64]
    action, profile = form.get("action", ""), form.get("profile", "")[:64]
    if action == "attach":
        done = await run_in_threadpool(actions.attach, console, user, team, cvm_id, profile)
    elif action == "detach":
        done = await run_in_threadpool(actions.detach, console, user, team, cvm_id, profile)
    elif action in ("stop", "start"):
        running = action == "start"
        done = await run_in_threadpool(actions.set_running, console, user, team, cvm_id, running)
    elif action == "destroy":
        if form.get("confirm") != "yes":
            raise HTTPException(422, "confirm: tick the box to destroy this CVM")
        done = await run_in_threadpool(actions.destroy, console, user, team, cvm_id)
    else:
        raise HTTPException(422, "action: attach, detach, start, stop or destroy")
    target = f"/ui/teams/{team}/cvms/{cvm_id}?" + urlencode({"done": done})
    return RedirectResponse(target, status.HTTP_303_SEE_OTHER)


@router.post("/teams/{team}/members/deactivate")
async def deactivate_member(request: Request, team: str) -> Response:
    session = _session(request)
    team = _team(team)
    form = await _form(request, session)
    if form.get("confirm") != "yes":
        raise HTTPException(422, "confirm: tick the box to deactivate this developer")
    subject = form.get("subject", "").strip()[:256]
    done = await run_in_threadpool(
        actions.deactivate, _console(request), session.user, team, subject
    )
    return RedirectResponse(
        f"/ui/teams/{team}/cvms?" + urlencode({"done": done}), status.HTTP_303_SEE_OTHER
    )


@router.get("/teams/{team}/profiles")
def profiles(request: Request, team: str) -> Response:
    session = _session(request)
    team = _team(team)
    data = queries.profiles(_console(request), session.user, team)
    return _page(request, session, team, "profiles", "profiles.html", data=data)


@router.get("/teams/{team}/usage")
def usage_page(request: Request, team: str) -> Response:
    session = _session(request)
    team = _team(team)
    report = usage_service.usage(console=_console(request), user=session.user, team=team)
    totals = {name: report.total(name) for name in ("requests", *usage_service.TOKENS)}
    return _page(request, session, team, "usage", "usage.html", report=report, totals=totals)


@router.get("/teams/{team}/secrets")
def secrets_page(request: Request, team: str) -> Response:
    session = _session(request)
    team = _team(team)
    data = queries.secret_list(_console(request), session.user, team)
    return _page(request, session, team, "secrets", "secrets.html", data=data)


@router.post("/teams/{team}/secrets/rotate")
async def rotate(request: Request, team: str) -> Response:
    session = _session(request)
    team = _team(team)
    form = await _form(request, session)
    name, value = form.get("name", "")[:128], form.get("value", "")
    done = await run_in_threadpool(
        actions.rotate_secret, _console(request), session.user, team, name, value
    )
    return RedirectResponse(
        f"/ui/teams/{team}/secrets?" + urlencode({"done": done}), status.HTTP_303_SEE_OTHER
    )


@router.get("/teams/{team}/audit")
def audit_page(request: Request, team: str) -> Response:
    session = _session(request)
    team = _team(team)
    before_raw = request.query_params.get("before")
    before = None
    if before_raw is not None:
        if not before_raw.isdigit() or len(before_raw) > 10:
            raise FilterError("before: a sequence number")
        before = int(before_raw)
    data = queries.audit_page(_console(request), session.user, team, before)
    return _page(request, session, team, "audit", "audit.html", data=data)
