"""Two teams in one program share nothing: own VPC/VNet, own identities, no peering, and no rule
of one team names the other's network, addresses or identities."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.infra.harness import ROOT, example_stack, raw_of, run_program
from umbra.components.config import TeamStack, parse_stack_config
from umbra.components.program import build_team

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

PEERINGS = {
    "gcp:compute/networkPeering:NetworkPeering",
    "gcp:servicenetworking/connection:Connection",
    "azure-native:network:VirtualNetworkPeering",
}


def _team(base: str, name: str, **overrides: Any) -> TeamStack:
    doc = example_stack(base) | {"team": name} | overrides
    cfg = parse_stack_config(raw_of(doc), frozenset())
    assert isinstance(cfg, TeamStack)
    return cfg


@pytest.mark.parametrize("base", ["acme-gcp", "globex-azure"])
def test_two_teams_share_nothing(base: str) -> None:
    # Same CIDRs on purpose: separate networks may overlap because nothing connects them.
    a, b = _team(base, "red"), _team(base, "blue")
    mocks, ids = run_program(
        lambda: {t.team: build_team(t, ROOT).network.network_id for t in (a, b)}
    )
    assert not [r for r in mocks.resources if r.typ in PEERINGS]
    assert ids["red"] != ids["blue"]
    by_team: dict[str, list[str]] = {"red": [], "blue": []}
    for r in mocks.resources:
        owner = "red" if r.name.startswith("red") else "blue"
        assert r.name.startswith(owner)
        by_team[owner].append(json.dumps(r.inputs, sort_keys=True))
    for me, other in (("red", "blue"), ("blue", "red")):
        blob = "\n".join(by_team[me])
        # Nothing of mine mentions the other team's VPC/VNet, resource group, identities or VMs.
        assert f"umbra-{other}" not in blob
        assert ids[other] not in blob
    if base == "acme-gcp":
        for fw in mocks.of_type("gcp:compute/firewall:Firewall"):
            owner = "red" if fw.name.startswith("red") else "blue"
            assert fw.inputs["network"] == ids[owner]
            for sa in fw.inputs.get("targetServiceAccounts", []) + fw.inputs.get(
                "sourceServiceAccounts", []
            ):
                assert sa.startswith(f"umbra-{owner}-")
    else:
        groups = {
            r.inputs["resourceGroupName"]
            for r in mocks.of_type("azure-native:resources:ResourceGroup")
        }
        assert groups == {"umbra-red", "umbra-blue"}
