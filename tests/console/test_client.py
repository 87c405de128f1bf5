"""The typed clients the CLI and the proxy use, against a running Console."""

from __future__ import annotations

import tempfile
import uuid
from pathlib import Path

import pytest

from tests.console import enroll
from tests.console.helpers import Server, Team, standard_bundle, traffic_record
from tests.console.oidc_issuer import LocalIssuer
from tests.console.security_cvm_client import SecurityCvmClient
from umbra.console.client import ConsoleApiError, ConsoleClient


def test_console_and_security_cvm_clients(server: Server, issuer: LocalIssuer, team: Team) -> None:
    admin_token = team.admin.headers["Authorization"].removeprefix("Bearer ")
    with ConsoleClient(server.url, admin_token) as client:
        assert client.me().roles == {team.name: "admin"}
        info = client.upload_bundle(team.name, standard_bundle(server.bundle_key, 1))
        assert client.list_bundles(team.name)[0].hash == info.hash
        security = client.create_cvm(team.name, "sec2", kind="security")
        assert "credential" not in security.model_dump()  # only enrollment issues it
        with tempfile.TemporaryDirectory(prefix="u11-client-") as tmp:
            credential = enroll.security_credential(server.url, team.admin, security.id, Path(tmp))
        dev = client.create_cvm(team.name, "dev", security_cvm_id=security.id)
        assert client.attach_profiles(dev.id, ["github"]).profiles == ["github"]
        assert client.update_cvm(dev.id, state="stopped").state == "stopped"
        secret = client.set_team_secret(team.name, "bot", "client-secret", ["api.example.com"])
        assert secret.ref == "team/bot"
        assert [s.name for s in client.list_secrets(team.name)] == ["bot"]
        with pytest.raises(ConsoleApiError) as error:
            client.create_cvm(team.name, "dev")
        assert error.value.status == 409
        with SecurityCvmClient(server.url, credential, security.id) as proxy:
            bundle = proxy.bundle()
            assert bundle.changed and bundle.etag == info.hash
            assert not proxy.bundle(bundle.etag).changed
            polled, doc = proxy.attachments()
            assert doc is not None and doc.cvms[dev.id]["profiles"] == ["github"]
            assert not proxy.attachments(polled.etag)[0].changed
            record = traffic_record(team.name, id=str(uuid.uuid4()), cvm_id=dev.id)
            assert proxy.ship_traffic([record]).inserted == 1
            assert proxy.ship_traffic([record]).duplicates == 1
        page = client.traffic(team.name, cvm_id=dev.id)
        assert [r.id for r in page.records] == [record["id"]]
        assert client.destroy_cvm(dev.id).state == "destroyed"
        assert [e.action for e in client.audit(team.name).entries][-1] == "cvm.destroy"
        client.delete_secret(team.name, "bot")
