"""`umbra auth`: log in to a Console and keep its URL and a bearer token for the other commands.

The token comes from the OIDC issuer's device flow (RFC 8628) when the issuer offers one, else
from `--token-file` or stdin. It is stored in `$XDG_CONFIG_HOME/umbra/console.json` (default
`~/.config/umbra/`), directory 0700 and file 0600, written by create-then-rename so that it is
never readable by others, and it is never printed.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any, NoReturn

import httpx
import typer
from pydantic import BaseModel, ConfigDict, ValidationError

from umbra.cli.output import EXIT_FINDINGS, EXIT_USAGE, console, fail, print_json
from umbra.console.client import ConsoleApiError, ConsoleClient

app = typer.Typer(help="Log in to an Umbra Console.", no_args_is_help=True)

JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")]
DEVICE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"


class Login(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str
    token: str
    team: str | None = None

    def __repr__(self) -> str:  # never show the token in tracebacks
        return f"Login(url={self.url!r}, team={self.team!r})"


def config_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "umbra"


def login_path() -> Path:
    return config_dir() / "console.json"


def save_login(login: Login) -> Path:
    directory = config_dir()
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    path = login_path()
    temp = path.with_suffix(".tmp")
    temp.unlink(missing_ok=True)
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(login.model_dump_json())
    os.replace(temp, path)
    return path


def load_login(as_json: bool = False) -> Login:
    path = login_path()
    try:
        return Login.model_validate_json(path.read_text())
    except FileNotFoundError:
        fail("not logged in: run `umbra auth login URL`", EXIT_USAGE, as_json=as_json)
    except (OSError, ValidationError):
        fail(f"{path} is unreadable: run `umbra auth login URL` again", EXIT_USAGE, as_json=as_json)


def open_client(as_json: bool = False) -> tuple[ConsoleClient, Login]:
    login = load_login(as_json)
    return ConsoleClient(login.url, login.token), login


def api_failure(exc: Exception, as_json: bool) -> NoReturn:
    """Console refusals exit 1 with its precise detail; an unreachable Console exits 2."""
    if isinstance(exc, ConsoleApiError):
        fail(f"console answered {exc.status}: {exc.detail}", EXIT_FINDINGS, as_json=as_json)
    if isinstance(exc, httpx.HTTPError):
        fail(f"cannot reach the Console ({type(exc).__name__})", EXIT_USAGE, as_json=as_json)
    raise exc


def resolve_team(client: ConsoleClient, login: Login, team: str | None, as_json: bool) -> str:
    """--team, else the login's default team, else the caller's only team."""
    if team:
        return team
    if login.team:
        return login.team
    try:
        teams = sorted(client.me().roles)
    except (ConsoleApiError, httpx.HTTPError) as exc:
        api_failure(exc, as_json)
    if len(teams) != 1:
        fail(
            f"pass --team (you are in {len(teams)} teams: {', '.join(teams)})",
            EXIT_USAGE,
            as_json=as_json,
        )
    return teams[0]


def _device_flow(issuer: str, client_id: str, scope: str) -> str | None:
    """The issuer's device flow, or None when it does not offer one."""
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
                token = body.get("access_token")
                if not isinstance(token, str):
                    raise ValueError("the issuer answered without an access_token")
                return token
            error = body.get("error")
            if error == "slow_down":
                interval += 5
            elif error != "authorization_pending":
                raise ValueError(f"the issuer refused the device login ({error})")
        raise ValueError("the device code expired before the login was approved")


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
            help="OIDC issuer: use its device flow when it offers one.", envvar="UMBRA_OIDC_ISSUER"
        ),
    ] = None,
    client_id: Annotated[
        str, typer.Option(help="OIDC client id for the device flow.")
    ] = "umbra-cli",
    scope: Annotated[str, typer.Option(help="Scopes for the device flow.")] = "openid",
    token_file: Annotated[
        Path | None,
        typer.Option("--token-file", help="Read the bearer token from a file ('-' for stdin)."),
    ] = None,
    team: Annotated[str | None, typer.Option(help="Default team for the other commands.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Store the Console URL and a bearer token (never printed) for the other commands."""
    if not url.startswith(("https://", "http://")):
        fail(
            "URL must start with https:// (http:// for loopback only)", EXIT_USAGE, as_json=as_json
        )
    token: str | None = None
    try:
        if issuer and token_file is None:
            token = _device_flow(issuer, client_id, scope)
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
    except (ConsoleApiError, httpx.HTTPError) as exc:
        api_failure(exc, as_json)
    path = save_login(Login(url=url.rstrip("/"), token=token, team=team))
    if as_json:
        print_json(
            {"ok": True, "url": url, "subject": me.subject, "roles": me.roles, "saved": str(path)}
        )
        return
    roles = ", ".join(f"{t}:{r}" for t, r in sorted(me.roles.items())) or "no roles"
    console.print(f"Logged in to {url} as [bold]{me.subject}[/] ({roles}); saved to {path}")


@app.command()
def status(as_json: JsonFlag = False) -> None:
    """Who the stored token says you are."""
    client, login_ = open_client(as_json)
    try:
        with client:
            me = client.me()
    except (ConsoleApiError, httpx.HTTPError) as exc:
        api_failure(exc, as_json)
    if as_json:
        print_json(
            {"url": login_.url, "subject": me.subject, "roles": me.roles, "team": login_.team}
        )
    else:
        console.print(f"{login_.url}: [bold]{me.subject}[/] {json.dumps(me.roles)}")


@app.command()
def logout() -> None:
    """Forget the stored token."""
    login_path().unlink(missing_ok=True)
    console.print("Logged out.")
