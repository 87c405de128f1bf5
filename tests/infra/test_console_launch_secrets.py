"""The Console stack under `set_mocks`: its database password and TLS key go into the cloud's
secret store (GCP Secret Manager, Azure Key Vault) readable by the Console VM's identity alone,
its launch data carries only references, the database URL without its password, the CA and the
certificate, and the launch agent accepts what the stack renders. The secrets' bytes appear in
no VM input, no export and no launch data."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from tests.infra.harness import Recorder, build_console_exports, console_stack
from umbra.components.config import ConfigError, ConsoleStack, parse_stack_config
from umbra.components.console_secrets import (
    AZURE_KEY_VAULT_SECRETS_USER,
    GCP_SECRET_ACCESSOR,
    azure_key_vault_name,
)
from umbra.components.program import NO_CONSOLE_TLS_WARNING
from umbra.components.secret_refs import SecretStore, secret_store
from umbra.images.launch_agent import parse_launch_data

from ..certs import self_signed

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

PASSWORD = "console-db-password-Qx81-never-shown"
SECRET_KEYS = frozenset(
    {"umbra:consoleDbPassword", "umbra:consoleTlsKey", "umbra:consoleWebSessionKey"}
)
WEB_KEY = base64.b64encode(b"web-session-key-32-bytes-never!!").decode()
SA = "serviceAccount:umbra-console@umbra-control.iam.gserviceaccount.com"


def _tls() -> tuple[str, str]:
    made = self_signed("console.umbra.example.com")
    return made.cert_pem.decode(), made.key_pem.decode()


CERT, KEY = _tls()


def _secret(value: Any) -> Any:
    """A Pulumi secret as the engine receives it (its signature, then the value): encrypted in
    state, masked in the CLI."""
    from pulumi.runtime import rpc

    assert isinstance(value, dict) and value[rpc._special_sig_key] == rpc._special_secret_sig
    return value["value"]


def _doc(cloud: str, cert_file: Path) -> dict[str, Any]:
    return console_stack(cloud) | {"tls_cert_file": str(cert_file)}


def _build(
    cloud: str, tmp_path: Path, web_key: str | None = None
) -> tuple[Recorder, dict[str, Any]]:
    cert_file = tmp_path / "console.crt"
    cert_file.write_text(CERT)
    raw = {
        "umbra:stack": json.dumps(_doc(cloud, cert_file)),
        "umbra:consoleDbPassword": PASSWORD,
        "umbra:consoleTlsKey": KEY,
    }
    if web_key is not None:
        raw["umbra:consoleWebSessionKey"] = web_key
    cfg = parse_stack_config(raw, SECRET_KEYS)
    assert isinstance(cfg, ConsoleStack)
    return build_console_exports(cfg, raw)


def _no_secret_outside(mocks: Recorder, exported: dict[str, Any], holders: set[str]) -> None:
    key_body = "".join(KEY.splitlines()[1:-1])[:40]
    for secret in (PASSWORD, KEY, key_body, WEB_KEY):
        for r in mocks.resources:
            if r.typ in holders:
                continue
            assert secret not in json.dumps(r.inputs, default=str), r.typ
            assert secret not in json.dumps(r.outputs, default=str), r.typ
        plain = {k: v for k, v in exported.items() if k != "database_url"}  # a secret output
        assert secret not in json.dumps(plain, default=str)
    assert KEY not in exported.get("database_url", "")


def test_gcp_secrets_live_in_secret_manager_read_by_the_console_identity_alone(
    tmp_path: Path,
) -> None:
    mocks, exported = _build("gcp", tmp_path)
    secrets = {r.inputs["secretId"]: r for r in mocks.of_type("gcp:secretmanager/secret:Secret")}
    assert sorted(secrets) == ["umbra-console-db-password", "umbra-console-tls-key"]
    versions = {
        r.inputs["secret"]: _secret(r.inputs["secretData"])
        for r in mocks.of_type("gcp:secretmanager/secretVersion:SecretVersion")
    }
    assert versions == {
        "projects/umbra-control/secrets/umbra-console-db-password": PASSWORD,
        "projects/umbra-control/secrets/umbra-console-tls-key": KEY,
    }
    # Granted per secret, to the Console's service account, never project-wide.
    grants = sorted(
        (r.inputs["secretId"], r.inputs["role"], r.inputs["member"])
        for r in mocks.of_type("gcp:secretmanager/secretIamMember:SecretIamMember")
    )
    assert grants == [
        ("umbra-console-db-password", GCP_SECRET_ACCESSOR, SA),
        ("umbra-console-tls-key", GCP_SECRET_ACCESSOR, SA),
    ]
    projects = [r.inputs["role"] for r in mocks.of_type("gcp:projects/iAMMember:IAMMember")]
    assert GCP_SECRET_ACCESSOR not in projects
    # The VM is created after the grants: its first boot reads the secrets.
    (vm,) = mocks.of_type("gcp:compute/instance:Instance")
    depends = mocks.options[("gcp:compute/instance:Instance", vm.name)].depends_on
    assert isinstance(depends, list) and len(depends) == 2
    meta = vm.inputs["metadata"]
    assert meta["umbra-database-password-ref"] == (
        "projects/umbra-control/secrets/umbra-console-db-password/versions/1"
    )
    assert meta["umbra-console-tls-key-ref"] == (
        "projects/umbra-control/secrets/umbra-console-tls-key/versions/1"
    )
    assert meta["umbra-console-tls-cert"] == CERT
    assert meta["umbra-database-url"] == (
        "postgresql://umbra_console@10.10.128.5:5432/umbra?sslmode=verify-full"
        "&sslrootcert=/run/umbra/launch/database-ca.pem"
    )
    # What the stack renders is what the Console VM's launch agent accepts.
    data = parse_launch_data({k: v for k, v in meta.items() if k.startswith("umbra-")}, "gcp")
    assert data.role == "console" and data.console_launch_sha256 is not None
    assert secret_store(meta["umbra-database-password-ref"]) == SecretStore.GCP_SECRET_MANAGER
    _no_secret_outside(
        mocks,
        exported,
        {"gcp:secretmanager/secretVersion:SecretVersion", "gcp:sql/user:User"},
    )


def test_azure_secrets_live_in_an_rbac_key_vault_read_by_the_vm_identity(tmp_path: Path) -> None:
    mocks, exported = _build("azure", tmp_path)
    (vault,) = mocks.of_type("azure-native:keyvault:Vault")
    props = vault.inputs["properties"]
    assert props["enableRbacAuthorization"] is True and "accessPolicies" not in props
    assert vault.inputs["vaultName"] == azure_key_vault_name("console", "sub-0000")
    assert 3 <= len(vault.inputs["vaultName"]) <= 24
    values = {
        r.inputs["secretName"]: _secret(r.inputs["properties"])["value"]
        for r in mocks.of_type("azure-native:keyvault:Secret")
    }
    assert values == {"db-password": PASSWORD, "tls-key": KEY}
    readers = [
        r
        for r in mocks.of_type("azure-native:authorization:RoleAssignment")
        if r.inputs["roleDefinitionId"].endswith(AZURE_KEY_VAULT_SECRETS_USER)
    ]
    assert [r.inputs["scope"] for r in readers] == ["console-kv-id"]
    (vm,) = mocks.of_type("azure-native:compute:VirtualMachine")
    meta = json.loads(base64.b64decode(vm.inputs["userData"]))["umbra"]
    vault_url = f"https://{vault.inputs['vaultName']}.vault.azure.net/secrets"
    assert meta["umbra-database-password-ref"] == f"{vault_url}/db-password/{'0' * 32}"
    assert meta["umbra-console-tls-key-ref"] == f"{vault_url}/tls-key/{'0' * 32}"
    # Flexible Server chains to public roots: no CA, no sslrootcert.
    assert "umbra-database-ca" not in meta
    assert meta["umbra-database-url"].endswith("?sslmode=verify-full")
    data = parse_launch_data(meta, "azure")
    assert data.role == "console"
    _no_secret_outside(
        mocks,
        exported,
        {"azure-native:keyvault:Secret", "azure-native:dbforpostgresql:Server"},
    )


def test_the_tls_key_comes_with_a_certificate_and_only_as_a_secret(tmp_path: Path) -> None:
    doc = _doc("gcp", tmp_path / "console.crt")
    base = {"umbra:stack": json.dumps(doc), "umbra:consoleDbPassword": PASSWORD}
    with pytest.raises(ConfigError, match="come together") as err:
        parse_stack_config(base, SECRET_KEYS)
    assert PASSWORD not in str(err.value)
    with_key = base | {"umbra:consoleTlsKey": KEY}
    with pytest.raises(ConfigError, match="consoleTlsKey: stored in plain text") as err:
        parse_stack_config(with_key, frozenset({"umbra:consoleDbPassword"}))
    assert KEY not in str(err.value)
    del doc["tls_cert_file"]
    no_cert = with_key | {"umbra:stack": json.dumps(doc)}
    with pytest.raises(ConfigError, match="come together"):
        parse_stack_config(no_cert, SECRET_KEYS)


def test_without_a_tls_certificate_the_stack_warns_that_the_console_will_not_start() -> None:
    assert "refuses to start the Console" in NO_CONSOLE_TLS_WARNING


def test_gcp_web_session_key_is_a_third_secret_with_its_own_grant_and_measured_ref(
    tmp_path: Path,
) -> None:
    mocks, exported = _build("gcp", tmp_path, WEB_KEY)
    versions = {
        r.inputs["secret"]: _secret(r.inputs["secretData"])
        for r in mocks.of_type("gcp:secretmanager/secretVersion:SecretVersion")
    }
    assert versions["projects/umbra-control/secrets/umbra-console-web-session-key"] == WEB_KEY
    grants = sorted(
        (r.inputs["secretId"], r.inputs["role"], r.inputs["member"])
        for r in mocks.of_type("gcp:secretmanager/secretIamMember:SecretIamMember")
    )
    assert ("umbra-console-web-session-key", GCP_SECRET_ACCESSOR, SA) in grants
    assert len(grants) == 3
    (vm,) = mocks.of_type("gcp:compute/instance:Instance")
    depends = mocks.options[("gcp:compute/instance:Instance", vm.name)].depends_on
    assert isinstance(depends, list) and len(depends) == 3
    meta = vm.inputs["metadata"]
    ref = "projects/umbra-control/secrets/umbra-console-web-session-key/versions/1"
    assert meta["umbra-console-web-session-key-ref"] == ref
    data = parse_launch_data({k: v for k, v in meta.items() if k.startswith("umbra-")}, "gcp")
    assert data.web_session_key_ref == ref
    # The reference is measured: the same launch without it hashes differently.
    from dataclasses import replace

    assert (
        data.console_launch_sha256 != replace(data, web_session_key_ref=None).console_launch_sha256
    )
    _no_secret_outside(
        mocks,
        exported,
        {"gcp:secretmanager/secretVersion:SecretVersion", "gcp:sql/user:User"},
    )


def test_azure_web_session_key_is_a_third_vault_secret(tmp_path: Path) -> None:
    mocks, exported = _build("azure", tmp_path, WEB_KEY)
    (vault,) = mocks.of_type("azure-native:keyvault:Vault")
    values = {
        r.inputs["secretName"]: _secret(r.inputs["properties"])["value"]
        for r in mocks.of_type("azure-native:keyvault:Secret")
    }
    assert values["web-session-key"] == WEB_KEY
    (vm,) = mocks.of_type("azure-native:compute:VirtualMachine")
    meta = json.loads(base64.b64decode(vm.inputs["userData"]))["umbra"]
    vault_url = f"https://{vault.inputs['vaultName']}.vault.azure.net/secrets"
    assert meta["umbra-console-web-session-key-ref"] == f"{vault_url}/web-session-key/{'0' * 32}"
    assert parse_launch_data(meta, "azure").web_session_key_ref is not None
    _no_secret_outside(
        mocks,
        exported,
        {"azure-native:keyvault:Secret", "azure-native:dbforpostgresql:Server"},
    )


def test_the_web_session_key_is_a_secret_of_the_consoles_shape(tmp_path: Path) -> None:
    doc = _doc("gcp", tmp_path / "console.crt")
    base = {
        "umbra:stack": json.dumps(doc),
        "umbra:consoleDbPassword": PASSWORD,
        "umbra:consoleTlsKey": KEY,
    }
    assert parse_stack_config(base, SECRET_KEYS)  # optional for one replica
    with pytest.raises(ConfigError, match="consoleWebSessionKey: stored in plain text") as err:
        parse_stack_config(
            base | {"umbra:consoleWebSessionKey": WEB_KEY},
            SECRET_KEYS - {"umbra:consoleWebSessionKey"},
        )
    assert WEB_KEY not in str(err.value)
    short = base64.b64encode(b"sixteen-bytes!!!").decode()
    for bad in (short, "not base64 at all!"):
        with pytest.raises(
            ConfigError, match=r"consoleWebSessionKey: .*want base64 of 32 bytes"
        ) as err:
            parse_stack_config(base | {"umbra:consoleWebSessionKey": bad}, SECRET_KEYS)
        assert bad not in str(err.value)
