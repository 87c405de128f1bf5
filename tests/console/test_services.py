"""The Console's services without HTTP: the same functions the API routes and the web view call,
raising domain errors that `routes/errors.py` maps to HTTP in one place."""

from __future__ import annotations

import pytest

from tests.console.helpers import Server, Team
from umbra.console.enums import CvmKind, CvmState, Power, Role, Scope
from umbra.console.routes.errors import STATUS, status_of
from umbra.console.schemas import CvmCreate
from umbra.console.services import cvms, errors, secrets, traffic
from umbra.console.services.access import User


def test_every_domain_error_has_one_http_status() -> None:
    kinds = set(errors.ServiceError.__subclasses__())
    assert kinds == set(STATUS)
    assert status_of(errors.not_found("CVM x")) == 404
    assert len(set(STATUS.values())) == len(STATUS)


def test_services_run_without_http(server: Server, team: Team) -> None:
    console = server.console
    admin = User(team.admin_subject, {team.name: Role.admin})
    dev = User(team.dev_subject, {team.name: Role.developer})
    stranger = User("nobody", {"other-team": Role.admin})

    info = cvms.launch(
        console=console, user=dev, team=team.name,
        request=CvmCreate(name="svc", security_cvm_id=team.scvm_id),
    )  # fmt: skip
    assert (info.kind, info.state, info.owner) == (CvmKind.dev, CvmState.running, dev.subject)
    with pytest.raises(errors.Conflict, match="already has a CVM 'svc'"):
        cvms.launch(
            console=console, user=dev, team=team.name,
            request=CvmCreate(name="svc", security_cvm_id=team.scvm_id),
        )  # fmt: skip
    with pytest.raises(errors.Forbidden, match="only admins launch Security CVMs"):
        cvms.launch(
            console=console, user=dev, team=team.name,
            request=CvmCreate(name="s2", kind=CvmKind.security),
        )  # fmt: skip
    with pytest.raises(errors.NotFound):  # invisible is the same as absent
        cvms.get(console=console, user=stranger, cvm_id=info.id)
    stopped = cvms.set_power(console=console, user=dev, cvm_id=info.id, power=Power.stopped)
    assert stopped.state == CvmState.stopped
    listed = cvms.list_cvms(console=console, user=dev, team=team.name, include_destroyed=False)
    assert info.id in [row.id for row in listed]

    with pytest.raises(errors.Forbidden):  # team secrets are the admins'
        secrets.set_secret(
            console=console, user=dev, team=team.name, scope=Scope.team, name="x", value="v",
            hosts=[],
        )  # fmt: skip
    made = secrets.set_secret(
        console=console, user=admin, team=team.name, scope=Scope.team, name="x", value="v",
        hosts=[],
    )  # fmt: skip
    with pytest.raises(errors.Stale, match="is at version 1, not version 7"):
        secrets.set_secret(
            console=console, user=admin, team=team.name, scope=Scope.team, name="x",
            value="v2", hosts=[], if_match='"7"',
        )  # fmt: skip
    rotated = secrets.rotate_team_secret(
        console=console, user=admin, team=team.name, name="x", value="v2"
    )
    assert (made.version, rotated.version) == (1, 2)

    with pytest.raises(errors.Forbidden, match="developers see their own traffic"):
        traffic.scoped(dev, team.name, traffic.TrafficFilters(owner="someone-else"))
    assert traffic.scoped(dev, team.name, traffic.TrafficFilters()).owner == dev.subject
    with pytest.raises(errors.Invalid, match="cursor"):
        traffic.page(
            console=console, team=team.name, filters=traffic.TrafficFilters(cursor="%%"), limit=1
        )
    assert cvms.destroy(console=console, user=dev, cvm_id=info.id).state == CvmState.destroyed
