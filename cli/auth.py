"""`umbra auth`: log in to a Console and keep its URL and a bearer token for the other commands.

`umbra auth login URL` asks the Console which OIDC issuer it trusts (`/api/v1/auth/oidc`) and runs
that issuer's device flow (RFC 8628) by default; `--token-file`/stdin is the fallback when the
issuer offers none. Tokens go to the OS keyring when one exists (python `keyring` with a real
backend), else to `$XDG_CONFIG_HOME/umbra/console.json` (directory 0700, file 0600, create-then-
rename); they are never printed. A refresh token, when the issuer gives one, renews the access
token silently; a session that truly expired says "run `umbra auth login`". `http://` Console
URLs are refused except for loopback.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

from umbra.cli.credentials import (
    Login,
    LoginMissing,
    config_dir,
    forget_login,
    fresh_login,
    login_path,
    save_login,
)
from umbra.cli.output import EXIT_FINDINGS, EXIT_USAGE, console, fail, print_json
from umbra.contracts.console_url import ConsoleUrlError, check_console_url

if TYPE_CHECKING:
    from umbra.console.client import ConsoleClient

__all__ = ["Login", "config_dir", "login_path", "save_login"]

app = typer.Typer(help="Log in to an Umbra Console.", no_args_is_help=True)

JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")]
DEVICE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"


def load_login(as_json: bool = False) -> Login:
    try:
        return fresh_login()
    except LoginMissing as exc:
        fail(str(exc), EXIT_USAGE, as_json=as_json)


def open_client(as_json: bool = False) -> tuple[ConsoleClient, Login]:
    from umbra.console.client import ConsoleClient

    login = load_login(as_json)
    return ConsoleClient(login.url, login.token), login


def api_errors() -> tuple[type[Exception], ...]:
    """What a Console call raises: its refusal, or the transport failing. For `except api_errors()`:
    an except clause is evaluated only when something is raised, so httpx and the client (and the
    policy package their schemas use) load when a command runs, never for `--help`."""
    import httpx

    from umbra.console.client import ConsoleApiError

    return (ConsoleApiError, httpx.HTTPError)


def api_failure(exc: Exception, as_json: bool) -> NoReturn:
    """Console refusals exit 1 with its precise detail; an unreachable Console exits 2."""
    import httpx

    from umbra.console.client import ConsoleApiError

    if isinstance(exc, ConsoleApiError):
        fail(f"console answered {exc.status}: {exc.detail}", EXIT_FINDINGS, as_json=as_json)
    if isinstance(exc, httpx.HTTPError):
        fail(unreachable(exc), EXIT_USAGE, as_json=as_json)
    raise exc


def unreachable(exc: Exception) -> str:
    """What to run when the Console does not answer: `umbra up` when the stored login is for the
    Console `umbra up` started (its embedded.json names that URL), else where it was tried."""
    from umbra.cli.credentials import embedded_client

    local = embedded_client()
    if local is not None:
        return f"the local Console does not answer at {local.console_url}; run `umbra up`"
    try:
        url = exc.request.url  # type: ignore[attr-defined]
        where = f" at {url.scheme}://{url.netloc.decode()}"
    except (AttributeError, RuntimeError):  # no request attached
        where = ""
    return (
        f"cannot reach the Console{where} ({type(exc).__name__}); check the URL and network, "
        "or run `umbra auth login URL` for another Console"
    )


def resolve_team(client: ConsoleClient, login: Login, team: str | None, as_json: bool) -> str:
    """--team, else the login's default team, else the caller's only team."""
    if team:
        return team
    if login.team:
        return login.team
    try:
        teams = sorted(client.me().roles)
    except api_errors() as exc:
        api_failure(exc, as_json)
    if len(teams) != 1:
        fail(
            f"pass --team (you are in {len(teams)} teams: {', '.join(teams)})",
            EXIT_USAGE,
            as_json=as_json,
        )
    return teams[0]


def team_call[T](
    team: str | None, as_json: bool, call: Callable[[ConsoleClient, str], T]
) -> tuple[str, T]:
    """One Console call for a team with the stored login: (the team `resolve_team` chose, what
    `call(client, team)` returned); a refusal or an unreachable Console exits as `api_failure`."""
    client, login = open_client(as_json)
    try:
        with client:
            team_name = resolve_team(client, login, team, as_json)
            return team_name, call(client, team_name)
    except api_errors() as exc:
        api_failure(exc, as_json)


def _device_flow(issuer: str, client_id: str, scope: str) -> dict[str, Any] | None:
    """The issuer's device flow (the token response plus `token_endpoint`), or None when it
    does not offer one."""
    import httpx

    with httpx.Client(timeout=30, follow_redirects=False) as http:
        discovery = http.get(issuer.rstrip("/") + "/.well-known/openid-configuration")
        discovery.raise_for_status()
        doc: dict[str, Any] = discovery.json()
        device_endpoint, token_endpoint = (
            doc.get("device_authorization_endpoint"),
            doc.get("token_endpoint"),
        )
        if not isinstance(device_endpoint, str) or not isinstance(token_endpoint, str):
            return None
        start = http.post(device_endpoint, data={"client_id": client_id, "scope": scope})
        start.raise_for_status()
        grant = start.json()
        where = grant.get("verification_uri_complete") or grant["verification_uri"]
        console.print(f"Open [bold]{where}[/] and enter code [bold]{grant['user_code']}[/]")
        interval = float(grant.get("interval", 5))
        deadline = time.monotonic() + float(grant.get("expires_in", 600))
        while time.monotonic() < deadline:
            time.sleep(interval)
            answer = http.post(
                token_endpoint,
                data={
                    "grant_type": DEVICE_GRANT,
                    "device_code": grant["device_code"],
                    "client_id": client_id,
                },
            )
            body = answer.json()
            if answer.status_code == 200:
                if not isinstance(body.get("access_token"), str):
                    raise ValueError("the issuer answered without an access_token")
                return {**body, "token_endpoint": token_endpoint}
            error = body.get("error")
            if error == "slow_down":
                interval += 5
            elif error != "authorization_pending":
                raise ValueError(f"the issuer refused the device login ({error})")
        raise ValueError("the device code expired before the login was approved")


def _console_issuer(url: str) -> tuple[str | None, str | None]:
    """The issuer and CLI client id the Console advertises; (None, None) if it says nothing."""
    import httpx

    try:
        answer = httpx.get(url.rstrip("/") + "/api/v1/auth/oidc", timeout=20)
        if answer.status_code != 200:
            return None, None
        doc = answer.json()
    except (httpx.HTTPError, ValueError):
        return None, None
    issuer, client_id = doc.get("issuer"), doc.get("client_id")
    return (
        issuer if isinstance(issuer, str) else None,
        client_id if isinstance(client_id, str) else None,
    )


def _read_token(token_file: Path | None) -> str:
    if token_file is not None:
        text = sys.stdin.read() if str(token_file) == "-" else token_file.read_text()
    elif not sys.stdin.isatty():
        text = sys.stdin.read()
    else:
        text = typer.prompt("Bearer token", hide_input=True)
    return text.strip()


@app.command()
def login(
    url: Annotated[str, typer.Argument(help="The Console's base URL.")],
    issuer: Annotated[
        str | None,
        typer.Option(
            help="OIDC issuer (default: the one the Console advertises); its device flow is used "
            "when it offers one.",
            envvar="UMBRA_OIDC_ISSUER",
        ),
    ] = None,
    client_id: Annotated[
        str | None, typer.Option(help="OIDC client id (default: the Console's, else umbra-cli).")
    ] = None,
    scope: Annotated[str, typer.Option(help="Scopes for the device flow.")] = "openid",
    token_file: Annotated[
        Path | None,
        typer.Option("--token-file", help="Read the bearer token from a file ('-' for stdin)."),
    ] = None,
    team: Annotated[str | None, typer.Option(help="Default team for the other commands.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Store the Console URL and a bearer token (never printed) for the other commands."""
    import httpx

    from umbra.console.client import ConsoleClient

    try:
        check_console_url(url)
    except ConsoleUrlError as exc:
        fail(str(exc), EXIT_USAGE, as_json=as_json)
    token: str | None = None
    grant: dict[str, Any] | None = None
    try:
        if token_file is None:
            advertised, advertised_client = _console_issuer(url)
            issuer = issuer or advertised
            client_id = client_id or advertised_client
        client_id = client_id or "umbra-cli"
        if issuer and token_file is None:
            grant = _device_flow(issuer, client_id, scope)
            token = grant["access_token"] if grant else None
        if token is None:
            token = _read_token(token_file)
    except (OSError, ValueError, KeyError, httpx.HTTPError) as exc:
        fail(
            f"could not obtain a token: {type(exc).__name__}: {str(exc)[:200]}",
            EXIT_USAGE,
            as_json=as_json,
        )
    if not token or any(ch.isspace() for ch in token):
        fail("the token is empty or not a single word", EXIT_USAGE, as_json=as_json)
    try:
        with ConsoleClient(url, token) as client:
            me = client.me()
    except api_errors() as exc:
        api_failure(exc, as_json)
    expires_in = grant.get("expires_in") if grant else None
    refresh = grant.get("refresh_token") if grant else None
    stored = save_login(
        Login(
            url=url.rstrip("/"),
            token=token,
            team=team,
            refresh_token=refresh if isinstance(refresh, str) else None,
            expires_at=int(time.time()) + int(expires_in) if isinstance(expires_in, int) else None,
            token_endpoint=grant["token_endpoint"] if grant else None,
            client_id=client_id if grant else None,
        )
    )
    if as_json:
        print_json(
            {
                "ok": True,
                "url": url,
                "subject": me.subject,
                "roles": me.roles,
                "saved": str(stored.path),
                "keyring": stored.keyring,
                "storage": stored.describe(),
            }
        )
        return
    roles = ", ".join(f"{t}:{r}" for t, r in sorted(me.roles.items())) or "no roles"
    console.print(f"Logged in to {url} as [bold]{me.subject}[/] ({roles})")
    console.print(stored.describe(), markup=False, highlight=False, soft_wrap=True)


@app.command()
def status(as_json: JsonFlag = False) -> None:
    """Who the stored token says you are."""
    client, login_ = open_client(as_json)
    try:
        with client:
            me = client.me()
    except api_errors() as exc:
        api_failure(exc, as_json)
    if as_json:
        print_json(
            {"url": login_.url, "subject": me.subject, "roles": me.roles, "team": login_.team}
        )
    else:
        console.print(f"{login_.url}: [bold]{me.subject}[/] {json.dumps(me.roles)}")


@app.command()
def logout() -> None:
    """Forget the stored token (and its OS keyring entry)."""
    path = forget_login()
    console.print(
        f"Logged out: removed {path} and its keyring entry, if any.", markup=False, soft_wrap=True
    )
