"""The launch agent's Console role: a Console VM's launch data carries its database URL and CA,
its TLS certificate and references to its two secrets; the agent reads the secrets with the VM's
identity (a stub reader here), checks the key against the measured certificate, measures the
launch (umbra.console-launch), writes the Console's files and starts its compose. Bad or
mismatched launch data starts nothing and says why in one serial line, and the secrets' bytes
appear in no output but the Console's own 0400 files."""

from __future__ import annotations

import base64
import json
import stat
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from umbra.attest.eventlog import Event, load_event_log
from umbra.components.launch_data import DATABASE_CA_PATH, LaunchData
from umbra.images.launch_agent import Agent, LaunchError, Refusal
from umbra.images.launch_secrets import SecretReadError
from umbra.images.measure import CONSOLE_LAUNCH_EVENT, instance_events, release_events
from umbra.sandbox.render import canonical_json

from ..certs import self_signed

PASSWORD = "pw-Zq8v!not-in-any-output-7c1e"
IMAGE = "ghcr.io/example/umbra-console@sha256:" + "ab" * 32
GCP_PW_REF = "projects/umbra-control/secrets/umbra-console-db-password/versions/1"
GCP_KEY_REF = "projects/umbra-control/secrets/umbra-console-tls-key/versions/1"
GCP_WEB_REF = "projects/umbra-control/secrets/umbra-console-web-session-key/versions/1"
WEB_KEY = base64.b64encode(b"web-session-key-not-in-output-32").decode()
AZ_WEB_REF = "https://umbra-console-kv.vault.azure.net/secrets/web-session-key"
AZ_PW_REF = "https://umbra-console-kv.vault.azure.net/secrets/db-password"
AZ_KEY_REF = "https://umbra-console-kv.vault.azure.net/secrets/tls-key"
DB_URL = f"postgresql://umbra_console@10.10.0.200:5432/umbra?sslmode=verify-full&sslrootcert={DATABASE_CA_PATH}"
AZ_DB_URL = "postgresql://umbra_console@umbra-console.postgres.database.azure.com:5432/umbra?sslmode=verify-full"


def _cert(cn: str) -> tuple[str, str]:
    made = self_signed(cn)
    return made.cert_pem.decode(), made.key_pem.decode()


TLS_CERT, TLS_KEY = _cert("console.example.org")
_, OTHER_KEY = _cert("someone-else")
DB_CA, _ = _cert("Google Cloud SQL Server CA")


def _compose(image: str = IMAGE) -> str:
    compose = (
        "name: umbra-console\n"
        "services:\n"
        "  console:\n"
        f"    image: {image}\n"
        '    command: ["umbra", "console", "serve"]\n'
        "    volumes:\n"
        '      - "/run/umbra/launch/console:/run/umbra/launch/console:ro"\n'
    )
    return canonical_json(
        {
            "docker_compose_file": compose,
            "manifest_version": 2,
            "name": "umbra-console",
            "runner": "docker-compose",
        }
    )


def _gcp() -> LaunchData:
    return LaunchData(
        role="console",
        team="console",
        cvm_id="umbra-console",
        app_compose=_compose(),
        database_ca=DB_CA,
        database_url=DB_URL,
        database_password_ref=GCP_PW_REF,
        console_tls_cert=TLS_CERT,
        console_tls_key_ref=GCP_KEY_REF,
        cloud="gcp",
    )


@dataclass
class Meta:
    meta: dict[str, str]
    name: str = "umbra-console"

    def fetch(self) -> dict[str, str]:
        # What GcpMetadata keeps of the instance attributes.
        return {k: v for k, v in self.meta.items() if k.startswith("umbra-")}

    def instance_name(self) -> str:
        return self.name


@dataclass
class Secrets:
    values: dict[str, str]
    reads: list[str] = field(default_factory=list)

    def read(self, ref: str) -> str:
        self.reads.append(ref)
        if ref not in self.values:
            raise SecretReadError(f"{ref}: HTTP 403")
        return self.values[ref]


@dataclass
class Recorder:
    started: list[str] = field(default_factory=list)
    extended: list[Event] = field(default_factory=list)

    def start(self, compose: Path) -> None:
        self.started.append(compose.read_text())

    def extend(self, event: Event) -> None:
        self.extended.append(event)


def _agent(
    meta: dict[str, str], secrets: Secrets | None, tmp_path: Path, cloud: str = "gcp"
) -> tuple[Agent, Recorder, list[str]]:
    rec, lines = Recorder(), list[str]()
    agent = Agent(
        source=Meta(meta),
        extender=rec,
        starter=rec,
        reporter=None,
        launch_dir=tmp_path / "launch",
        say=lines.append,
        cloud=cloud,
        secrets=secrets,
        console_uid=None,
    )
    return agent, rec, lines


def _good_secrets(pw_ref: str = GCP_PW_REF, key_ref: str = GCP_KEY_REF) -> Secrets:
    return Secrets({pw_ref: PASSWORD, key_ref: TLS_KEY})


def test_a_console_launch_reads_its_secrets_measures_and_starts_its_compose(
    tmp_path: Path,
) -> None:
    data = _gcp()
    secrets = _good_secrets()
    agent, rec, lines = _agent(data.gcp_metadata(), secrets, tmp_path)
    agent.run()
    launch = tmp_path / "launch"
    assert rec.started == [json.loads(data.app_compose)["docker_compose_file"]]
    assert sorted(secrets.reads) == sorted([GCP_PW_REF, GCP_KEY_REF])
    # What a verifier replays: the compose hash, the id, then the Console's launch.
    assert [e.name for e in rec.extended] == ["compose-hash", "umbra.cvm-id", CONSOLE_LAUNCH_EVENT]
    assert CONSOLE_LAUNCH_EVENT in data.expected_events()  # launch_data's name is measure's
    console = data.console_launch_sha256
    assert console is not None
    predicted = release_events(bytes.fromhex(data.compose_sha256)) + instance_events(
        "console", "umbra-console", console_launch=bytes.fromhex(console)
    )
    assert [e.digest for e in rec.extended] == [e.digest for e in predicted]
    log = load_event_log((launch / "event-log.json").read_bytes())
    assert [e.name for e in log][-1] == CONSOLE_LAUNCH_EVENT
    # The Console's files: the full URL and the key for its uid alone, the CA where sslrootcert is.
    url = (launch / "console/database-url").read_text().strip()
    assert url == DB_URL.replace("umbra_console@", f"umbra_console:{PASSWORD.replace('!', '%21')}@")
    for secret_file in ("console/database-url", "console/tls.key"):
        assert stat.S_IMODE((launch / secret_file).stat().st_mode) == 0o400
    assert (launch / "console/tls.key").read_text() == TLS_KEY
    assert (launch / "console/tls.crt").read_text() == TLS_CERT
    assert (launch / "database-ca.pem").read_text() == DB_CA
    assert not (launch / "security").exists() and not (launch / "forwarder").exists()
    assert lines[-1].startswith("umbra-launch: console umbra-console started")


def _web() -> LaunchData:
    return replace(_gcp(), web_session_key_ref=GCP_WEB_REF)


def _web_secrets(value: str = WEB_KEY) -> Secrets:
    return Secrets(_good_secrets().values | {GCP_WEB_REF: value})


def test_a_console_with_a_web_session_key_reads_it_and_writes_it_for_its_uid_alone(
    tmp_path: Path,
) -> None:
    data = _web()
    secrets = _web_secrets()
    agent, rec, _ = _agent(data.gcp_metadata(), secrets, tmp_path)
    agent.run()
    assert GCP_WEB_REF in secrets.reads and len(rec.started) == 1
    key_file = tmp_path / "launch/console/web-session-key"
    assert key_file.read_text().strip() == WEB_KEY
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o400
    # Its reference is measured: the launch event is the one naming it, not the one without.
    (event,) = [e for e in rec.extended if e.name == CONSOLE_LAUNCH_EVENT]
    assert event.payload.hex() == data.console_launch_sha256
    assert data.console_launch_sha256 != _gcp().console_launch_sha256
    # What the Console reads (UMBRA_CONSOLE_WEB_SESSION_KEY_FILE) is what the file holds.
    from umbra.console.config import settings_from_env

    settings = settings_from_env(
        {"UMBRA_CONSOLE_WEB_SESSION_KEY_FILE": str(key_file)}, database_url="sqlite://"
    )
    assert settings.web_session_key == WEB_KEY


def test_without_a_web_session_key_reference_nothing_is_read_or_written(tmp_path: Path) -> None:
    secrets = _good_secrets()
    agent, _, _ = _agent(_gcp().gcp_metadata(), secrets, tmp_path)
    agent.run()
    assert GCP_WEB_REF not in secrets.reads
    assert not (tmp_path / "launch/console/web-session-key").exists()


def test_a_console_mounts_no_data_disk(tmp_path: Path) -> None:
    """The CLI's default is a disk found in sysfs, which a Console VM does not have: mounting
    one would refuse every Console launch ("no data disk")."""

    class NoDisk:
        def mount(self) -> str:
            raise AssertionError("a Console has no data disk")

    agent, rec, _ = _agent(_gcp().gcp_metadata(), _good_secrets(), tmp_path)
    agent.data_disk = NoDisk()
    agent.run()
    assert len(rec.started) == 1


def test_an_azure_console_reads_key_vault_references_and_needs_no_database_ca(
    tmp_path: Path,
) -> None:
    data = replace(
        _gcp(),
        database_ca=None,
        database_url=AZ_DB_URL,
        database_password_ref=AZ_PW_REF,
        console_tls_key_ref=AZ_KEY_REF,
        cloud="azure",
    )
    meta = json.loads(base64.b64decode(data.azure_user_data()))["umbra"]
    agent, rec, _ = _agent(meta, _good_secrets(AZ_PW_REF, AZ_KEY_REF), tmp_path, "azure")
    agent.run()
    assert len(rec.started) == 1
    assert not (tmp_path / "launch/database-ca.pem").exists()


Mutation = Callable[[dict[str, str]], dict[str, str]]


def _put(key: str, value: str) -> Mutation:
    return lambda meta: meta | {key: value}


def _drop(key: str) -> Mutation:
    return lambda meta: {k: v for k, v in meta.items() if k != key}


def _bad_compose(meta: dict[str, str]) -> dict[str, str]:
    data = replace(_gcp(), app_compose=_compose("ghcr.io/example/umbra-console:latest"))
    return data.gcp_metadata()


CASES: list[tuple[str, Refusal, Mutation, Secrets | None]] = [
    ("no database CA for a verify-full sslrootcert", Refusal.MISSING,
     _drop("umbra-database-ca"), _good_secrets()),
    ("a database CA the URL does not use", Refusal.MISMATCH,
     _put("umbra-database-url", AZ_DB_URL), _good_secrets()),
    ("a database CA that is no certificate", Refusal.INVALID,
     _put("umbra-database-ca", "not a pem"), _good_secrets()),
    ("no TLS key reference", Refusal.MISSING, _drop("umbra-console-tls-key-ref"), _good_secrets()),
    ("no TLS certificate", Refusal.MISSING, _drop("umbra-console-tls-cert"), _good_secrets()),
    ("a TLS key that is not the certificate's", Refusal.MISMATCH, lambda m: m,
     Secrets({GCP_PW_REF: PASSWORD, GCP_KEY_REF: OTHER_KEY})),
    ("a TLS key that is no key", Refusal.INVALID, lambda m: m,
     Secrets({GCP_PW_REF: PASSWORD, GCP_KEY_REF: "garbage"})),
    ("a Key Vault reference on GCP", Refusal.MISMATCH,
     _put("umbra-database-password-ref", AZ_PW_REF), _good_secrets()),
    ("a reference of neither shape", Refusal.INVALID,
     _put("umbra-console-tls-key-ref", "file:///etc/shadow"), _good_secrets()),
    ("a password in the database URL", Refusal.INVALID,
     _put("umbra-database-url", DB_URL.replace("umbra_console@", "umbra_console:pw@")),
     _good_secrets()),
    ("sslmode weaker than verify-full", Refusal.INVALID,
     _put("umbra-database-url", DB_URL.replace("verify-full", "require")), _good_secrets()),
    ("an unreadable secret", Refusal.SECRET_UNREADABLE, lambda m: m,
     Secrets({GCP_KEY_REF: TLS_KEY})),
    ("no secret reader", Refusal.SECRET_UNREADABLE, lambda m: m, None),
    ("an enrollment token", Refusal.INVALID,
     _put("umbra-enrollment-token", "tok_" + "a" * 40), _good_secrets()),
    ("SSH keys", Refusal.INVALID, _put("umbra-ssh-authorized-keys",
     "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl a\n"),
     _good_secrets()),
    ("an image not pinned by digest", Refusal.INVALID, _bad_compose, _good_secrets()),
    ("a measured copy that differs", Refusal.MISMATCH,
     _put("umbra-rtmr3-events", "{}"), _good_secrets()),
    ("an unreadable web session key", Refusal.SECRET_UNREADABLE,
     lambda m: _web().gcp_metadata(), _good_secrets()),
    ("a web session key of the wrong length", Refusal.INVALID,
     lambda m: _web().gcp_metadata(), _web_secrets(base64.b64encode(b"short").decode())),
    ("a web session key that is no base64", Refusal.INVALID,
     lambda m: _web().gcp_metadata(), _web_secrets("not base64 " + WEB_KEY)),
    ("a Key Vault web session key reference on GCP", Refusal.MISMATCH,
     _put("umbra-console-web-session-key-ref", AZ_WEB_REF), _good_secrets()),
]  # fmt: skip


@pytest.mark.parametrize(("what", "reason", "mutate", "secrets"), CASES, ids=[c[0] for c in CASES])
def test_a_bad_console_launch_starts_nothing_and_says_why_once(
    tmp_path: Path, what: str, reason: Refusal, mutate: Mutation, secrets: Secrets | None
) -> None:
    agent, rec, lines = _agent(mutate(_gcp().gcp_metadata()), secrets, tmp_path)
    with pytest.raises(LaunchError) as err:
        agent.run()
    assert err.value.reason == reason, str(err.value)
    assert rec.started == [] and rec.extended == []
    assert not (tmp_path / "launch").exists()
    assert len(lines) == 1 and lines[0].startswith(
        f"umbra-launch: REFUSED, nothing started: {reason}"
    )
    for secret in (PASSWORD, TLS_KEY, OTHER_KEY, WEB_KEY):
        assert secret not in lines[0]


def test_console_keys_are_refused_on_other_roles(tmp_path: Path) -> None:
    from umbra.components.launch_data import placeholder_app_compose
    from umbra.images.launch_agent import parse_launch_data

    data = replace(_gcp(), role="security-cvm", app_compose=placeholder_app_compose("security"))
    meta = data.as_metadata()
    with pytest.raises(LaunchError) as err:
        parse_launch_data(meta, "gcp")
    assert err.value.reason == Refusal.INVALID
    assert "only a Console takes" in str(err.value)
    placeholder = placeholder_app_compose("security")
    only_web = LaunchData(
        role="security-cvm", team="t", cvm_id="c", app_compose=placeholder,
        web_session_key_ref=GCP_WEB_REF,
    )  # fmt: skip
    with pytest.raises(LaunchError, match="only a Console takes"):
        parse_launch_data(only_web.as_metadata(), "gcp")


def _all_bytes(root: Path, skip: set[Path]) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in root.rglob("*") if p.is_file() and p not in skip}


def test_the_secrets_are_in_no_output_but_the_consoles_own_files(tmp_path: Path) -> None:
    data = _web()
    agent, rec, lines = _agent(data.gcp_metadata(), _web_secrets(), tmp_path)
    returned = agent.run()
    launch = tmp_path / "launch"
    own = {launch / "console/database-url", launch / "console/tls.key"}
    own.add(launch / "console/web-session-key")
    outputs: dict[str, Any] = _all_bytes(launch, own)
    outputs |= {
        "serial": "\n".join(lines).encode(),
        "gcp metadata": json.dumps(data.gcp_metadata()).encode(),
        "azure user data": base64.b64decode(replace(data, cloud="azure").azure_user_data()),
        "events": b"".join(e.payload + e.name.encode() for e in rec.extended),
        "returned": repr(returned).encode(),
    }
    key_body = "".join(TLS_KEY.splitlines()[1:-1]).encode()
    for where, blob in outputs.items():
        for secret in (PASSWORD.encode(), TLS_KEY.encode(), key_body[:40], WEB_KEY.encode()):
            assert secret not in blob, where
    from umbra.images.console_launch import ConsoleSecrets

    assert PASSWORD not in repr(ConsoleSecrets(PASSWORD, TLS_KEY))
    assert TLS_KEY not in repr(ConsoleSecrets(PASSWORD, TLS_KEY))
    assert WEB_KEY not in repr(ConsoleSecrets(PASSWORD, TLS_KEY, WEB_KEY))
