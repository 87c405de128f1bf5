"""Admin actions from the web view: thin calls into the very functions the API routes run.

Each action therefore checks the same roles, takes the same locks and appends the same audit
entry as its API twin; the web layer only turns form fields into the API's request models.
"""

from __future__ import annotations

from fastapi import HTTPException, status
from pydantic import ValidationError

from umbra.console.deps import User
from umbra.console.routes import cvms as cvm_routes
from umbra.console.routes import secrets as secret_routes
from umbra.console.schemas import CvmUpdate, ProfilesUpdate, TeamSecretSet
from umbra.console.state import Console
from umbra.console.web import queries


def _invalid(exc: ValidationError) -> HTTPException:
    # Never echo the input (a secret value may be in it): field names and messages only.
    problems = "; ".join(
        f"{'.'.join(str(p) for p in error['loc']) or 'value'}: {error['msg']}"
        for error in exc.errors(include_input=False)
    )
    return HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, problems)


def _in_team(console: Console, user: User, team: str, cvm_id: str) -> None:
    queries.cvm_detail(console, user, team, cvm_id)  # 404 unless visible and in this team


def set_profiles(console: Console, user: User, team: str, cvm_id: str, names: list[str]) -> str:
    _in_team(console, user, team, cvm_id)
    try:
        body = ProfilesUpdate(profiles=names)
    except ValidationError as exc:
        raise _invalid(exc) from None
    info = cvm_routes.attach_profiles(cvm_id, body, console, user)
    return f"profiles of {info.name}: {', '.join(info.profiles) or 'none'}"


def attach(console: Console, user: User, team: str, cvm_id: str, profile: str) -> str:
    current = queries.cvm_detail(console, user, team, cvm_id).cvm.profiles
    return set_profiles(console, user, team, cvm_id, sorted({*current, profile}))


def detach(console: Console, user: User, team: str, cvm_id: str, profile: str) -> str:
    current = queries.cvm_detail(console, user, team, cvm_id).cvm.profiles
    if profile not in current:
        raise HTTPException(status.HTTP_409_CONFLICT, f"profile {profile!r} is not attached")
    return set_profiles(console, user, team, cvm_id, [p for p in current if p != profile])


def set_running(console: Console, user: User, team: str, cvm_id: str, running: bool) -> str:
    _in_team(console, user, team, cvm_id)
    state = "running" if running else "stopped"
    info = cvm_routes.update_cvm(cvm_id, CvmUpdate(state=state), console, user)
    return f"{info.name} is {info.state}"


def destroy(console: Console, user: User, team: str, cvm_id: str) -> str:
    _in_team(console, user, team, cvm_id)
    info = cvm_routes.destroy_cvm(cvm_id, console, user)
    return f"{info.name} is {info.state}"


def rotate_secret(console: Console, user: User, team: str, name: str, value: str) -> str:
    """A new value for an existing team secret; its hosts stay as they are."""
    queries.team_role(user, team, "admin")
    state = queries.team_secret_state(console, team, name)
    if state is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"team secret {name!r} not found")
    hosts, version = state
    try:
        body = TeamSecretSet(value=value, hosts=hosts)
    except ValidationError as exc:
        raise _invalid(exc) from None
    # Conditional on the version whose hosts were read: a concurrent change gets 412, never a
    # silent overwrite of hosts someone else just set (as `umbra secret rotate` does).
    info = secret_routes.set_team_secret(team, name, body, console, user, f'"{version}"')
    return f"team/{info.name} is now version {info.version}"
