"""Admin actions from the web view: adapters over the very services the API routes call.

Each action therefore checks the same roles, takes the same locks and appends the same audit
entry as its API twin; the web layer only turns form fields into the services' arguments and
their result into a one-line message.
"""

from __future__ import annotations

from pydantic import ValidationError

from umbra.console.enums import Power
from umbra.console.schemas import ProfilesUpdate
from umbra.console.services import cvms, people, secrets
from umbra.console.services.access import User
from umbra.console.services.errors import Conflict, Invalid
from umbra.console.state import Console
from umbra.contracts.validation import problems


def _invalid(exc: ValidationError) -> Invalid:
    # Never echo the input (a secret value may be in it): field names and messages only.
    return Invalid(problems(exc))


def set_profiles(console: Console, user: User, team: str, cvm_id: str, names: list[str]) -> str:
    try:
        body = ProfilesUpdate(profiles=names)
    except ValidationError as exc:
        raise _invalid(exc) from None
    info = cvms.attach_profiles(
        console=console, user=user, cvm_id=cvm_id, profiles=body.profiles, team=team
    )
    return f"profiles of {info.name}: {', '.join(info.profiles) or 'none'}"


def attach(console: Console, user: User, team: str, cvm_id: str, profile: str) -> str:
    current = cvms.get(console=console, user=user, cvm_id=cvm_id, team=team).profiles
    return set_profiles(console, user, team, cvm_id, sorted({*current, profile}))


def detach(console: Console, user: User, team: str, cvm_id: str, profile: str) -> str:
    current = cvms.get(console=console, user=user, cvm_id=cvm_id, team=team).profiles
    if profile not in current:
        raise Conflict(f"profile {profile!r} is not attached")
    return set_profiles(console, user, team, cvm_id, [p for p in current if p != profile])


def set_running(console: Console, user: User, team: str, cvm_id: str, running: bool) -> str:
    cvms.get(console=console, user=user, cvm_id=cvm_id, team=team)  # only in this team
    power = Power.running if running else Power.stopped
    info = cvms.set_power(console=console, user=user, cvm_id=cvm_id, power=power)
    return f"{info.name} is {info.state}"


def destroy(console: Console, user: User, team: str, cvm_id: str) -> str:
    cvms.get(console=console, user=user, cvm_id=cvm_id, team=team)  # only in this team
    info = cvms.destroy(console=console, user=user, cvm_id=cvm_id)
    return f"{info.name} is {info.state}"


def rotate_secret(console: Console, user: User, team: str, name: str, value: str) -> str:
    """A new value for an existing team secret; its hosts stay as they are."""
    info = secrets.rotate_team_secret(console=console, user=user, team=team, name=name, value=value)
    return f"team/{info.name} is now version {info.version}"


def deactivate(console: Console, user: User, team: str, subject: str) -> str:
    """Deactivate a developer (services/people.py): the one-line summary of what it did."""
    if not subject or len(subject) > 255 or not subject.isprintable() or " " in subject:
        raise Invalid("subject: the developer's OIDC subject, without spaces")
    done = people.deactivate(console=console, user=user, team=team, subject=subject)
    state = "deactivated" if done.newly else "was already deactivated"
    parts = [
        f"{subject} {state}: {done.secrets_erased} personal secrets erased",
        f"{len(done.cvms_detached)} CVMs detached, {len(done.cvms_stopped)} stopped",
    ]
    if done.cvms_skipped:
        parts.append(f"{len(done.cvms_skipped)} busy (deactivate again later)")
    return "; ".join(parts)
