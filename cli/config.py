"""`umbra config show`: the client configuration in effect, and where each part comes from.

Reads the stored login file only for its non-secret fields (URL, default team, where the tokens
are kept); never the keyring, never a token, so it works offline and is safe to paste into a bug
report (a test searches its output for the token bytes)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer

from umbra.cli.credentials import (
    NO_KEYRING_ENV,
    Login,
    config_dir,
    embedded_client,
    embedded_client_path,
    known_hosts_path,
    login_path,
)
from umbra.cli.output import console, print_json
from umbra.cli.ssh_config import IDENTITY_ENV

app = typer.Typer(help="The umbra client's configuration.", no_args_is_help=True)

JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")]
# The variables that change what the client does, by name (values are shown only when they are
# paths or switches, never credentials).
SIMULATED_PKI_ENV = "UMBRA_SIMULATED_PKI"  # = ssh_attest's, which loads attestation: not for help
UP_STATE_DIR = Path(".umbra")  # `umbra up`'s default --state-dir, relative to where it ran


def _login() -> dict[str, Any]:
    """The stored login's non-secret fields, or why there is none."""
    path = login_path()
    try:
        login = Login.model_validate_json(path.read_text())
    except FileNotFoundError:
        return {"logged_in": False, "hint": "run `umbra auth login URL`"}
    except (OSError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        hint = f"{path} is unreadable ({type(exc).__name__}): run `umbra auth login URL` again"
        return {"logged_in": False, "hint": hint}
    return {
        "logged_in": True,
        "console_url": login.url,
        "team": login.team,
        "tokens": (
            f"OS keyring ({login.keyring_backend or 'default backend'})"
            if login.keyring
            else f"{path} (0600)"
        ),
        "refreshes": login.refresh_token is not None
        or (login.keyring and login.token_endpoint is not None),
    }


def effective() -> dict[str, Any]:
    local = embedded_client()
    identity_env = os.environ.get(IDENTITY_ENV)
    if identity_env:
        identity, source = identity_env, IDENTITY_ENV
    elif local is not None:
        identity, source = local.ssh_identity, "umbra up"
    else:
        identity, source = None, "ssh's default keys"
    pki_env = os.environ.get(SIMULATED_PKI_ENV)
    return {
        **_login(),
        "config_dir": str(config_dir()),
        "login_file": str(login_path()),
        "known_hosts": str(known_hosts_path()),
        "ssh_identity": identity,
        "ssh_identity_source": source,
        "local_console": local is not None,  # the login is for the Console `umbra up` started
        "embedded_file": str(embedded_client_path()),
        "simulated_pki": pki_env or (local.simulated_pki if local is not None else None),
        "keyring_disabled": bool(os.environ.get(NO_KEYRING_ENV)),
        "up_state_dir": str(UP_STATE_DIR.resolve()),
    }


@app.command()
def show(as_json: JsonFlag = False) -> None:
    """The effective client configuration: Console, team, files and keys (never a token)."""
    info = effective()
    if as_json:
        print_json(info)
        return
    width = max(len(key) for key in info)
    for key, value in info.items():
        shown = "-" if value is None else str(value)
        console.print(f"{key:<{width}}  {shown}", markup=False, highlight=False, soft_wrap=True)
