"""A synchronous provider (called inside the request's transaction) has its facts recorded like
a background run's, and receives the Dev CVM's one-time enrollment token as launch data, never a
long-lived credential."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.console.helpers import Server, Team
from umbra.console.providers import CvmProvider, CvmSpec, OnProviderEvent, Provisioned


class Recording:
    name = "local"
    background = False
    default_data_disk_gb: int | None = None

    def __init__(self) -> None:
        self.launched: list[CvmSpec] = []

    def check(self, spec: CvmSpec) -> None:
        return None

    def launch(self, spec: CvmSpec, on_event: OnProviderEvent) -> Provisioned:
        self.launched.append(spec)
        return Provisioned(f"sync:{spec.id}", {"runtime": "sync", "address": "10.0.0.7"})

    def update(self, spec: CvmSpec, ref: str, on_event: OnProviderEvent) -> Provisioned:
        return Provisioned(ref, {"runtime": "sync", "keys": len(spec.ssh_keys)})

    def set_running(self, ref: str, running: bool) -> None:
        return None

    def destroy(self, spec: CvmSpec, ref: str | None, on_event: OnProviderEvent) -> None:
        return None


@pytest.fixture
def recording(server: Server) -> Iterator[Recording]:
    providers = server.console.providers
    previous: CvmProvider = providers["local"]
    provider = Recording()
    providers["local"] = provider
    try:
        yield provider
    finally:
        providers["local"] = previous


def test_a_synchronous_providers_state_is_persisted(team: Team, recording: Recording) -> None:
    created = team.dev.post(
        f"/api/v1/teams/{team.name}/cvms",
        json={"name": "sync-box", "security_cvm_id": team.scvm_id},
    )
    assert created.status_code == 201, created.text
    cvm = created.json()
    assert cvm["state"] == "running"
    assert cvm["provider_state"] == {"runtime": "sync", "address": "10.0.0.7"}
    shown = team.dev.get(f"/api/v1/cvms/{cvm['id']}").json()
    assert shown["provider_state"] == {"runtime": "sync", "address": "10.0.0.7"}

    # Launch data: a one-time token for the Dev CVM, hidden from repr, absent from the response.
    (spec,) = recording.launched
    assert spec.enrollment_token is not None and spec.enrollment_token.startswith("enr_")
    assert spec.enrollment_token not in repr(spec) and spec.enrollment_token not in created.text

    key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBvSJc0X5ZBW9Vh1cRZe1ZuJYbLD3zH3V2b1pXyk0x5m k"
    updated = team.dev.patch(f"/api/v1/cvms/{cvm['id']}", json={"ssh_keys": [key]})
    assert updated.status_code == 200, updated.text
    assert updated.json()["provider_state"] == {"runtime": "sync", "keys": 1}
