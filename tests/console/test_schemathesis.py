"""Property-based requests generated from the OpenAPI spec: no input may produce a 5xx.

Requests are authenticated (an admin of a fuzz team, or that team's Security CVM) so that they
get past authentication into validation and the handlers."""

from __future__ import annotations

import re
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from tests.console.helpers import Server, new_team
from tests.console.oidc_issuer import LocalIssuer
from tests.console.test_authz_matrix import RefuseAll
from umbra.console.app import create_app
from umbra.console.config import Settings

schema = schemathesis.openapi.from_dict(create_app(Settings(database_url="sqlite://")).openapi())
NAME = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,62}[a-z0-9])?$")
MACHINE_PATHS = ("/api/v1/security-cvms/", "/api/v1/traffic/")


@pytest.fixture(scope="module")
def fuzz_context(server: Server, issuer: LocalIssuer) -> dict[str, Any]:
    # Deployed state: secret release is configured (unconfigured, it answers 503 by design).
    server.console.release_verifier = RefuseAll()
    team = new_team(server, issuer)
    team.upload(1)
    dev = team.dev_cvm("fuzz-dev")
    return {
        "team": team.name,
        "scvm_id": team.scvm_id,
        "dev_cvm": dev,
        "user": team.admin.headers["Authorization"],
        "machine": team.scvm.headers["Authorization"],
    }


@schema.parametrize()
@settings(
    max_examples=15,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_no_input_causes_a_server_error(
    case: Any, server: Server, fuzz_context: dict[str, Any]
) -> None:
    params = case.path_parameters or {}
    if isinstance(params.get("team"), str) and NAME.match(params["team"]):
        params["team"] = fuzz_context["team"]
    if "cvm_id" in params and str(params["cvm_id"]).startswith("cvm_"):
        is_machine = case.path.startswith(MACHINE_PATHS)
        params["cvm_id"] = fuzz_context["scvm_id" if is_machine else "dev_cvm"]
    machine = case.path.startswith(MACHINE_PATHS)
    headers = {"Authorization": fuzz_context["machine" if machine else "user"]}
    response = case.call(base_url=server.url, headers=headers, timeout=60)
    case.validate_response(response, checks=[not_a_server_error])
