"""Measurement policy files: strict schema, precise errors with file and line, binding rules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from umbra.attest.errors import PolicyFileError
from umbra.attest.measurement import (
    SSH_KEYS_EVENT,
    load_instance_binding,
    load_measurement_policy,
    load_release_manifest,
    ssh_keys_digest,
)

MR = "ab" * 48
KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl dev@laptop"

RELEASE_YAML = f"""\
apiVersion: umbra/v1
kind: ReleaseManifest
name: dev-cvm-2025.07
tee: tdx
mrtd: ["{MR}"]
rtmr0: ["{MR}", "{"cd" * 48}"]
rtmr1: ["{MR}"]
rtmr2: ["{MR}"]
events:
  - name: compose-hash
    payloads: ["{"11" * 32}"]
tcb:
  allowed_statuses: [UpToDate, SWHardeningNeeded]
  max_collateral_age_seconds: 86400
td:
  attributes: {{value: "0x10000000", mask: "0x10000001"}}
"""

BINDING_YAML = f"""\
apiVersion: umbra/v1
kind: InstanceBinding
release: dev-cvm-2025.07
instance_id: dev-alice-1
ssh_authorized_keys:
  - "{KEY}"
"""


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_release_and_binding_load(tmp_path: Path) -> None:
    rel = _write(tmp_path, "release.yaml", RELEASE_YAML)
    bind = _write(tmp_path, "binding.yaml", BINDING_YAML)
    policy = load_measurement_policy(rel, bind)
    assert policy.tee == "tdx"
    assert policy.release.rtmr0 == [MR, "cd" * 48]
    assert policy.release.td.attributes.value == 0x10000000
    names = [e.name for e in policy.expected_events()]
    assert names == ["compose-hash", SSH_KEYS_EVENT]
    ssh = policy.expected_events()[1]
    assert ssh.payloads == [ssh_keys_digest([KEY]).hex()]


def test_json_form_loads_too(tmp_path: Path) -> None:
    doc = yaml.safe_load(RELEASE_YAML)
    p = _write(tmp_path, "release.json", json.dumps(doc))
    assert load_release_manifest(p).name == "dev-cvm-2025.07"


def test_unknown_key_names_file_line_and_field(tmp_path: Path) -> None:
    text = RELEASE_YAML.replace(
        "  max_collateral_age_seconds", "  max_age: 5\n  max_collateral_age_seconds"
    )
    p = _write(tmp_path, "release.yaml", text)
    with pytest.raises(PolicyFileError) as info:
        load_release_manifest(p)
    msg = str(info.value)
    line = text.splitlines().index("  max_age: 5") + 1
    assert f"{p}:{line}: tcb.max_age: Extra inputs are not permitted" in msg


def test_bad_measurement_length(tmp_path: Path) -> None:
    p = _write(
        tmp_path, "release.yaml", RELEASE_YAML.replace(f'rtmr1: ["{MR}"]', 'rtmr1: ["abcd"]')
    )
    with pytest.raises(PolicyFileError, match=r"rtmr1\.0: Value error, must be 48 bytes"):
        load_release_manifest(p)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (
            ("apiVersion: umbra/v1", "apiVersion: umbra/v2"),
            "apiVersion 'umbra/v2' is not supported",
        ),
        (("tee: tdx", "tee: sev"), "tee: Input should be 'tdx' or 'simulated'"),
        ((f'mrtd: ["{MR}"]', "mrtd: []"), "mrtd: List should have at least 1 item"),
        (("[UpToDate, SWHardeningNeeded]", "[Revoked]"), "Revoked can never be allowed"),
        (("name: compose-hash", "name: compose-hash\n  - name: compose-hash"), "listed twice"),
        (("kind: ReleaseManifest", "kind: Profile"), "kind: Input should be 'ReleaseManifest'"),
    ],
)
def test_schema_violations(tmp_path: Path, change: tuple[str, str], needle: str) -> None:
    p = _write(tmp_path, "release.yaml", RELEASE_YAML.replace(*change))
    with pytest.raises(PolicyFileError, match=needle):
        load_release_manifest(p)


def test_binding_for_another_release_is_refused(tmp_path: Path) -> None:
    rel = _write(tmp_path, "release.yaml", RELEASE_YAML)
    bind = _write(
        tmp_path, "b.yaml", BINDING_YAML.replace("release: dev-cvm-2025.07", "release: x")
    )
    with pytest.raises(PolicyFileError, match="binding is for release 'x'"):
        load_measurement_policy(rel, bind)


def test_binding_rejects_bad_ssh_keys(tmp_path: Path) -> None:
    bind = _write(tmp_path, "b.yaml", BINDING_YAML.replace(KEY, "not a key"))
    with pytest.raises(PolicyFileError, match="not an OpenSSH public key"):
        load_instance_binding(bind)


def test_missing_and_unparsable_files(tmp_path: Path) -> None:
    with pytest.raises(PolicyFileError, match="cannot read"):
        load_release_manifest(tmp_path / "nope.yaml")
    with pytest.raises(PolicyFileError, match="not valid"):
        load_release_manifest(_write(tmp_path, "x.yaml", "a: [b"))
    with pytest.raises(PolicyFileError, match="top level must be a mapping"):
        load_release_manifest(_write(tmp_path, "y.yaml", "- 1"))


def test_ssh_key_digest_ignores_comments_and_order() -> None:
    other = "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC7 x"
    assert ssh_keys_digest([KEY, other]) == ssh_keys_digest([other, KEY.rsplit(" ", 1)[0]])
    assert ssh_keys_digest([KEY]) != ssh_keys_digest([other])
