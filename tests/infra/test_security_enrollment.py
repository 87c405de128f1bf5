"""Each Security CVM replica of a team stack gets its own Console identity: its CVM id in its
launch data and its own one-time enrollment token, read from Pulumi secret config and carried
only inside secret values (encrypted in state). Config problems name the key, never the token."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from tests.infra.harness import ROOT, Recorder, example_stack, raw_of, run_program
from umbra.components.config import ConfigError, TeamStack, parse_stack_config
from umbra.components.launch_data import CVM_ID_EVENT, META_CVM_ID, META_ENROLLMENT_TOKEN
from umbra.components.program import build_team
from umbra.contracts.enrollment import security_token_key

SECRET_SIG = "4dabf18193072939515e22adb298388d"  # Pulumi's marker of a secret value
INSTANCE = "gcp:compute/instance:Instance"
AZURE_VM = "azure-native:compute:VirtualMachine"
IDS = ["cvm_5ec0000000000000", "cvm_5ec0000000000001", "cvm_5ec0000000000002"]
TOKENS = [f"enr_replica{i}-{'x' * 32}" for i in range(3)]


def configured(
    stack: dict[str, Any], replicas: int, *, secret: bool = True
) -> tuple[dict[str, str], frozenset[str]]:
    stack["security_cvm"]["replicas"] = replicas
    stack["security_cvm"]["cvm_ids"] = IDS[:replicas]
    raw = raw_of(stack)
    keys = [security_token_key(i) for i in range(replicas)]
    # Piped from `--token-only`, a value may end in a newline.
    raw.update({key: TOKENS[i] + "\n" for i, key in enumerate(keys)})
    return raw, frozenset(keys if secret else ())


def build(raw: Mapping[str, str], secret: frozenset[str]) -> Recorder:
    cfg = parse_stack_config(raw, secret)
    assert isinstance(cfg, TeamStack)
    mocks, _ = run_program(lambda: build_team(cfg, ROOT / "no-such-root").security.instance_id)
    return mocks


def unwrap_secret(value: Any) -> Any:
    assert isinstance(value, dict) and SECRET_SIG in value, "launch data must be a secret"
    return value["value"]


def plaintext(value: Any) -> Iterator[str]:
    """Every string in `value` outside Pulumi secrets (what state would hold in clear)."""
    if isinstance(value, dict):
        if SECRET_SIG in value:
            return
        for item in value.values():
            yield from plaintext(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from plaintext(item)
    elif isinstance(value, str):
        yield value


def assert_no_token_in_plaintext(mocks: Recorder) -> None:
    for res in mocks.resources:
        for text in plaintext(dict(res.inputs)):
            for token in TOKENS:
                assert token not in text, res.name
                assert base64.b64encode(token.encode()).decode()[:40] not in text, res.name


def test_gcp_replicas_each_carry_their_own_id_and_token_as_secrets() -> None:
    mocks = build(*configured(example_stack("acme-gcp"), 3))
    replicas = {"acme-security": 0, "acme-security-1": 1, "acme-security-2": 2}
    for name, i in replicas.items():
        meta = unwrap_secret(mocks.one(INSTANCE, name).inputs["metadata"])
        assert meta[META_CVM_ID] == IDS[i]
        assert meta[META_ENROLLMENT_TOKEN] == TOKENS[i]  # its own, stripped of the newline
        events = json.loads(meta["umbra-rtmr3-events"])
        assert events[CVM_ID_EVENT] == IDS[i].encode().hex()  # bound into its quotes
        assert TOKENS[i].encode().hex() not in str(events)  # the token is not measured
    assert_no_token_in_plaintext(mocks)


def test_azure_replicas_each_carry_their_own_token_in_secret_user_data() -> None:
    mocks = build(*configured(example_stack("globex-azure"), 2))
    for name, i in (("globex-security", 0), ("globex-security-1", 1)):
        vm = mocks.one(AZURE_VM, name).inputs
        blob = unwrap_secret(vm["userData"])
        meta = json.loads(base64.b64decode(blob))["umbra"]
        assert (meta[META_CVM_ID], meta[META_ENROLLMENT_TOKEN]) == (IDS[i], TOKENS[i])
    assert_no_token_in_plaintext(mocks)


def test_without_cvm_ids_no_replica_gets_a_token() -> None:
    stack = example_stack("acme-gcp")
    cfg = parse_stack_config(raw_of(stack), frozenset())
    assert isinstance(cfg, TeamStack) and cfg.security_enrollment_tokens() == ()
    mocks, _ = run_program(lambda: build_team(cfg, ROOT / "no-such-root").security.instance_id)
    meta = mocks.one(INSTANCE, "acme-security").inputs["metadata"]
    assert META_ENROLLMENT_TOKEN not in meta


def _error(raw: Mapping[str, str], secret: frozenset[str]) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_stack_config(raw, secret)
    message = str(caught.value)
    assert not any(token in message for token in TOKENS), "a config error shows no token"
    return message


def test_a_token_in_plain_config_is_refused_by_key() -> None:
    message = _error(*configured(example_stack("acme-gcp"), 2, secret=False))
    assert "umbra:securityEnrollmentToken0: stored in plain text" in message
    assert "umbra:securityEnrollmentToken1: stored in plain text" in message


def test_each_replica_needs_its_token_and_the_ids_match_the_replicas() -> None:
    raw, secret = configured(example_stack("acme-gcp"), 2)
    del raw[security_token_key(1)]
    message = _error(raw, secret)
    assert "umbra:securityEnrollmentToken1: required key is missing" in message
    assert "umbra cvm security-replica 1 --token-only | pulumi config set --secret" in message

    stack = example_stack("acme-gcp")
    raw, secret = configured(stack, 2)
    stack["security_cvm"]["cvm_ids"] = IDS[:3]
    raw.update(raw_of(stack))
    assert "security_cvm.cvm_ids names 3 CVM(s) for 2 replica(s)" in _error(raw, secret)

    raw, secret = configured(example_stack("acme-gcp"), 1)
    raw[security_token_key(2)] = TOKENS[2]
    message = _error(raw, secret | {security_token_key(2)})
    assert "umbra:securityEnrollmentToken2: there is no replica 2" in message

    stack = example_stack("acme-gcp")
    raw = raw_of(stack) | {security_token_key(0): TOKENS[0]}
    assert "cvm_ids: required with enrollment tokens" in _error(
        raw, frozenset({security_token_key(0)})
    )

    raw, secret = configured(example_stack("acme-gcp"), 1)
    raw[security_token_key(0)] = "not-a-token"
    assert "securityEnrollmentToken0: not an enrollment token" in _error(raw, secret)


# --- team-stack Dev CVMs: a Console id and a one-time token each ---------------------------------

DEV_ID = "cvm_dede000000000001"
DEV_TOKEN = "enr_devcvm-" + "y" * 32


def test_a_team_stack_dev_cvm_carries_its_console_id_and_token_as_a_secret() -> None:
    """Fails before the fix: team-stack Dev CVMs got no token and their VM name as CVM id, so
    their forwarder could never get a tunnel credential."""
    from umbra.contracts.enrollment import dev_token_key

    stack = example_stack("acme-gcp")
    dev = stack["developers"][0]
    dev["cvm_ids"] = {dev["cvms"][0] if "cvms" in dev else "main": DEV_ID}
    cvm = next(iter(dev["cvm_ids"]))
    key = dev_token_key(dev["name"], cvm)
    raw = raw_of(stack) | {key: DEV_TOKEN + "\n"}
    mocks = build(raw, frozenset({key}))
    instance = next(r for r in mocks.of_type(INSTANCE) if r.name == f"acme-{dev['name']}-{cvm}")
    meta = unwrap_secret(instance.inputs["metadata"])
    assert (meta[META_CVM_ID], meta[META_ENROLLMENT_TOKEN]) == (DEV_ID, DEV_TOKEN)
    assert json.loads(meta["umbra-rtmr3-events"])[CVM_ID_EVENT] == DEV_ID.encode().hex()
    for res in mocks.resources:
        assert all(DEV_TOKEN not in text for text in plaintext(dict(res.inputs))), res.name
    # Problems name the key, never the token.
    for bad_raw, secret, message in [
        (raw, frozenset(), "stored in plain text"),
        (raw_of(stack), frozenset(), "required key is missing"),
        (raw | {key: "not-a-token"}, frozenset({key}), "not an enrollment token"),
        (raw | {dev_token_key(dev["name"], "nope"): DEV_TOKEN}, frozenset({key}), "no developers"),
    ]:
        with pytest.raises(ConfigError, match=message) as exc:
            parse_stack_config(bad_raw, secret)
        assert DEV_TOKEN not in str(exc.value)
