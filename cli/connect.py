"""`umbra connect claude|codex` and `umbra disconnect claude|codex` (docs/specs/console.md,
"Agent logins"): the agent's own login becomes the developer's personal secret of the right kind,
and the profile that injects it is attached to the developer's Dev CVM(s); the sandbox holds only
the placeholder the profile's `sandbox_env` puts there. Nothing read here is ever printed.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from umbra.cli.auth import api_errors, api_failure, open_client, resolve_team
from umbra.cli.output import EXIT_USAGE, console, fail, print_json, stderr
from umbra.contracts.agent_logins import (
    AGENT_LOGINS,
    CODEX_PLACEHOLDER,
    Agent,
    AgentLogin,
    codex_placeholder_auth,
)

if TYPE_CHECKING:
    from umbra.console.client import ConsoleClient
    from umbra.console.schemas import CvmInfo

connect_app = typer.Typer(add_completion=False)
disconnect_app = typer.Typer(add_completion=False)

CODEX_TOKEN_URL = "https://auth.openai.com/oauth/token"  # noqa: S105 (an endpoint)
# `claude setup-token` prints one long-lived OAuth token of this shape.
CLAUDE_TOKEN = re.compile(r"sk-ant-oat[0-9A-Za-z_-]{10,}")

AgentArg = Annotated[Agent, typer.Argument(help="The agent: claude or codex.")]
CvmOpt = Annotated[
    list[str] | None,
    typer.Option("--cvm", help="A Dev CVM of yours (repeat; default: all your live Dev CVMs)."),
]
TeamOpt = Annotated[str | None, typer.Option("--team", help="Team (default: your login's team).")]
JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")]


def _read(path: str, what: str) -> str:
    if path == "-":
        return sys.stdin.read()
    try:
        return Path(path).expanduser().read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise typer.BadParameter(f"{path}: cannot read ({reason})", param_hint=what) from None


def claude_token(token_file: str | None, as_json: bool) -> str:
    """The subscription token: from the file (or stdin), else from `claude setup-token`'s own
    output (its stdout captured, never echoed; the browser sign-in uses the terminal)."""
    if token_file is not None:
        text = _read(token_file, "--token-file")
    elif shutil.which("claude") is not None:
        done = subprocess.run(["claude", "setup-token"], stdout=subprocess.PIPE, text=True)
        if done.returncode != 0:
            fail(f"`claude setup-token` exited {done.returncode}", as_json=as_json)
        text = done.stdout
    else:
        fail("no --token-file and no `claude` on PATH: run `claude setup-token` and pass the token "
             "it prints with --token-file F (or '-' for stdin)", EXIT_USAGE, as_json=as_json)  # fmt: skip
    found = CLAUDE_TOKEN.findall(text)
    if len(found) == 1:
        return str(found[0])
    token = text.strip()
    if not token or any(c.isspace() for c in token) or not token.isprintable():
        fail("expected one token (the sk-ant-oat… line `claude setup-token` prints)", EXIT_USAGE,
             as_json=as_json)  # fmt: skip
    return token


def _jwt_claims(token: str) -> dict[str, Any]:
    try:
        payload = token.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (IndexError, ValueError):
        return {}
    return claims if isinstance(claims, dict) else {}


def codex_document(auth_file: str, as_json: bool) -> tuple[str, str]:
    """An `oauth2-refresh` document from Codex's ChatGPT login (`~/.codex/auth.json`): the
    refresh and access tokens, the access token's expiry and the client id from the id token's
    `aud` (not hard-coded); and the sandbox's placeholder `auth.json` (identity claims only).
    Runs `codex login` first when the file holds no tokens."""
    path = Path(auth_file).expanduser()
    login_first = auth_file != "-" and not path.exists() and shutil.which("codex") is not None
    if login_first and subprocess.run(["codex", "login"], stdout=subprocess.DEVNULL).returncode:
        fail("`codex login` did not complete", as_json=as_json)
    try:
        doc = json.loads(_read(auth_file, "--auth-file"))
        tokens = doc["tokens"]
        refresh, access, id_token = (tokens["refresh_token"], tokens["access_token"],
                                     tokens["id_token"])  # fmt: skip
    except (ValueError, KeyError, TypeError):
        fail(f"{auth_file}: no ChatGPT login in it (tokens.refresh_token, access_token, id_token): "
             "run `codex login` first", EXIT_USAGE, as_json=as_json)  # fmt: skip
    identity = _jwt_claims(str(id_token))
    aud = identity.get("aud")
    client_id = aud[0] if isinstance(aud, list) and aud else aud
    if not isinstance(client_id, str) or not client_id:
        fail(f"{auth_file}: the id token names no client (aud)", EXIT_USAGE, as_json=as_json)
    document: dict[str, Any] = {
        "kind": "oauth2-refresh", "token_url": CODEX_TOKEN_URL, "client_id": client_id,
        "refresh_token": refresh, "access_token": access,
    }  # fmt: skip
    exp = _jwt_claims(str(access)).get("exp")
    if isinstance(exp, int | float):
        document["expires_at"] = float(exp)
    account = tokens.get("account_id")
    placeholder = codex_placeholder_auth(
        identity, account if isinstance(account, str) else None, time.time()
    )
    return json.dumps(document), placeholder


# Written as the developer in the sandbox, atomically; the text (no secret) comes on stdin.
INSTALL_CODEX_AUTH = (
    "umask 077 && mkdir -p ~/.codex && cat > ~/.codex/auth.json.umbra && "
    "mv ~/.codex/auth.json.umbra ~/.codex/auth.json"
)
REMOVE_CODEX_AUTH = f"! grep -qs {CODEX_PLACEHOLDER} ~/.codex/auth.json || rm -f ~/.codex/auth.json"


def _in_sandbox(cvm_id: str, command: str, text: str = "") -> str | None:
    """Run `command` in the Dev CVM's sandbox as the developer through `umbra ssh` (the attested
    path); None when done, else why not (the caller warns: the login itself is stored)."""
    umbra = str(Path(sys.executable).parent / "umbra")
    try:
        done = subprocess.run(
            [umbra, "ssh", "--no-reuse", cvm_id, "--", command],
            input=text, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return type(exc).__name__
    if done.returncode != 0:
        return " ".join(done.stderr.split())[-300:] or f"exit {done.returncode}"
    return None


def _checked(login: AgentLogin, value: str, as_json: bool) -> str:
    from pydantic import ValidationError

    from umbra.contracts.secret_kinds import material_text, parse_material
    from umbra.contracts.validation import problems

    try:
        return material_text(parse_material(login.kind, value))
    except ValidationError as exc:
        fail(f"{login.kind} secret: {problems(exc)}", EXIT_USAGE, as_json=as_json)
    except ValueError as exc:
        fail(str(exc), EXIT_USAGE, as_json=as_json)


def _own_cvms(client: ConsoleClient, team: str, wanted: list[str] | None) -> list[CvmInfo]:
    from umbra.console.enums import CvmKind, CvmState

    me = client.me().subject
    mine = [
        c for c in client.list_cvms(team)
        if c.kind == CvmKind.dev and c.owner == me and c.state != CvmState.destroyed
    ]  # fmt: skip
    if wanted:
        missing = sorted(set(wanted) - {c.id for c in mine})
        if missing:
            fail(f"not a live Dev CVM of yours: {', '.join(missing)}", EXIT_USAGE)
        mine = [c for c in mine if c.id in wanted]
    return mine


def _attach(client: ConsoleClient, cvm: CvmInfo, profile: str, on: bool) -> None:
    from umbra.console.schemas import profiles_etag

    wanted = sorted((set(cvm.profiles) | {profile}) if on else (set(cvm.profiles) - {profile}))
    if wanted != sorted(cvm.profiles):
        client.attach_profiles(cvm.id, wanted, if_match=profiles_etag(cvm.profiles))


@connect_app.command()
def connect(
    agent: AgentArg,
    token_file: Annotated[
        str | None,
        typer.Option("--token-file", help="claude: the setup-token output ('-': stdin)."),
    ] = None,
    auth_file: Annotated[
        str, typer.Option("--auth-file", help="codex: its auth.json ('-': stdin).")
    ] = "~/.codex/auth.json",
    cvm: CvmOpt = None,
    team: TeamOpt = None,
    as_json: JsonFlag = False,
) -> None:
    """Store your agent login as a personal secret and attach its profile to your Dev CVM(s)."""
    login = AGENT_LOGINS[agent]
    client, user = open_client(as_json)  # before any login flow: fail fast
    placeholder = ""
    if agent == Agent.claude:
        value = claude_token(token_file, as_json)
    else:
        value, placeholder = codex_document(auth_file, as_json)
    value = _checked(login, value, as_json)
    try:
        with client:
            team_name = resolve_team(client, user, team, as_json)
            cvms = _own_cvms(client, team_name, cvm)
            info = client.set_personal_secret(
                team_name, login.secret, value, list(login.hosts), kind=login.kind
            )
            for one in cvms:
                _attach(client, one, login.profile, True)
    except api_errors() as exc:
        api_failure(exc, as_json)
    ids = [c.id for c in cvms]
    # Codex reads its login from a file: each sandbox gets the placeholder one.
    failed = {i: why for i in ids if placeholder and (why := _in_sandbox(i, INSTALL_CODEX_AUTH,
                                                                        placeholder))}  # fmt: skip
    for cvm_id, why in failed.items():
        stderr.print(f"{cvm_id}: the placeholder ~/.codex/auth.json was not written ({why}); run "
                     "`umbra connect codex` again when the CVM is reachable", style="yellow")  # fmt: skip
    result: dict[str, Any] = {"agent": agent, "secret": info.ref, "kind": info.kind,
                              "profile": login.profile, "cvms": ids}  # fmt: skip
    shadowed = {c.id: found for c in cvms if (found := sorted(set(c.profiles)
                                                                & set(login.shadowed_by)))}  # fmt: skip
    for cvm_id, names in shadowed.items():
        stderr.print(f"{cvm_id}: {', '.join(names)} also attached: its API key would be used "
                     f"instead of your login; detach it (`umbra profile detach {cvm_id} "
                     f"{names[0]}`, an admin's) to use the subscription", style="yellow")  # fmt: skip
    if shadowed:
        result["shadowed_by"] = shadowed
    if placeholder:
        result["placeholder_written"] = [i for i in ids if i not in failed]
    if as_json:
        print_json(result)
    else:
        console.print(
            f"Connected {agent}: [bold]{info.ref}[/] ({info.kind}); profile {login.profile} "
            f"attached to {', '.join(ids) or 'no Dev CVM yet (run connect again after one)'}"
        )
        if placeholder and result["placeholder_written"]:
            console.print("Placeholder ~/.codex/auth.json written in "
                          + ", ".join(result["placeholder_written"]))  # fmt: skip
    if agent == Agent.codex:
        stderr.print("The refresh token rotates on use: run `codex logout` here so this machine "
                      "and the Security CVM do not both spend it.", style="yellow")  # fmt: skip


@disconnect_app.command()
def disconnect(
    agent: AgentArg, cvm: CvmOpt = None, team: TeamOpt = None, as_json: JsonFlag = False
) -> None:
    """Detach the agent's profile from your Dev CVM(s) and delete your stored login."""
    from umbra.console.client import ConsoleApiError

    login = AGENT_LOGINS[agent]
    client, user = open_client(as_json)
    deleted = True
    try:
        with client:
            team_name = resolve_team(client, user, team, as_json)
            cvms = _own_cvms(client, team_name, cvm)
            for one in cvms:
                _attach(client, one, login.profile, False)
            try:
                client.delete_secret(team_name, login.secret, personal=True)
            except ConsoleApiError as exc:
                if exc.status != 404:
                    raise
                deleted = False
    except api_errors() as exc:
        api_failure(exc, as_json)
    ids = [c.id for c in cvms]
    if agent == Agent.codex:  # the placeholder login goes too (a real one is left alone)
        for cvm_id in ids:
            if (why := _in_sandbox(cvm_id, REMOVE_CODEX_AUTH)) is not None:
                stderr.print(f"{cvm_id}: ~/.codex/auth.json not checked ({why})", style="yellow")
    if as_json:
        print_json({"agent": agent, "deleted": deleted, "profile": login.profile, "cvms": ids})
    else:
        console.print(
            f"Disconnected {agent}: profile {login.profile} detached from "
            f"{', '.join(ids) or 'no Dev CVM'}; personal/{login.secret} "
            f"{'deleted' if deleted else 'was not stored'}"
        )
