"""`sandbox_env`: placeholders and non-secret variables a profile puts into the sandbox; a value
that looks like a real credential (the scanner's rules, built-in and the profile's own) is refused
at its file, line and field; two profiles setting one variable differently do not compose; a
profile without it compiles (and so hashes and signs) exactly as before it existed."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.policy.helpers import policy, profile
from tests.policy.test_loader import HEADER, issues_of, write
from umbra.policy.compose import CompositionError
from umbra.policy.loader import load_policy_dir

FAKE_AWS_KEY = "AKIA" + "ABCDEFGHIJKLMNOP"  # the built-in aws-access-key-id shape


def test_placeholders_and_plain_values_are_accepted(tmp_path: Path) -> None:
    write(
        tmp_path,
        "claude.yaml",
        HEADER + "name: claude\n"
        "sandbox_env:\n"
        "  CLAUDE_CODE_OAUTH_TOKEN: 'umbra-placeholder:personal/claude'\n"
        "  AWS_ACCESS_KEY_ID: umbra-placeholder\n"
        "  AWS_REGION: us-east-1\n",
    )
    loaded = load_policy_dir(tmp_path).profiles["claude"].compiled
    assert loaded.sandbox_env == {
        "AWS_ACCESS_KEY_ID": "umbra-placeholder",
        "AWS_REGION": "us-east-1",
        "CLAUDE_CODE_OAUTH_TOKEN": "umbra-placeholder:personal/claude",
    }
    assert policy(loaded).sandbox_env["AWS_REGION"] == "us-east-1"


@pytest.mark.parametrize(
    ("value", "rule"),
    [
        (FAKE_AWS_KEY, "builtin:aws-access-key-id"),
        ("ghp_" + "a" * 36, "builtin:github-token"),
        ("-----BEGIN PRIVATE KEY-----", "builtin:pem-private-key"),
        ("acme_" + "Z" * 32, "scan:acme"),  # the profile's own scan rule
    ],
)
def test_a_credential_looking_value_is_refused_at_its_line(
    tmp_path: Path, value: str, rule: str
) -> None:
    write(
        tmp_path,
        "leaky.yaml",
        HEADER + "name: leaky\n"
        "scan:\n  - {id: acme, regex: 'acme_[A-Za-z0-9]{32}'}\n"
        f"sandbox_env:\n  SOME_TOKEN: '{value}'\n",
    )
    [(file, line, field, message)] = issues_of(tmp_path)
    assert (file, field) == ("leaky.yaml", "sandbox_env")
    assert line == 6  # the sandbox_env line
    assert f"SOME_TOKEN looks like a real credential ({rule})" in message
    assert value not in message  # the value is never echoed


def test_reserved_names_and_control_characters_are_refused(tmp_path: Path) -> None:
    write(tmp_path, "a.yaml", HEADER + "name: a\nsandbox_env:\n  HTTPS_PROXY: http://evil\n")
    [(_, _, field, message)] = issues_of(tmp_path)
    assert field == "sandbox_env" and "HTTPS_PROXY is set by the sandbox itself" in message
    write(tmp_path, "a.yaml", HEADER + 'name: a\nsandbox_env:\n  X: "a\\nb"\n')
    [(_, _, _, message)] = issues_of(tmp_path)
    assert "control character" in message


def test_two_profiles_setting_one_variable_differently_do_not_compose() -> None:
    one = profile("one", sandbox_env={"AWS_REGION": "us-east-1"})
    same = profile("same", sandbox_env={"AWS_REGION": "us-east-1"})
    other = profile("other", sandbox_env={"AWS_REGION": "eu-west-1"})
    assert policy(one, same).sandbox_env == {"AWS_REGION": "us-east-1"}
    with pytest.raises(CompositionError, match="sets AWS_REGION to another value"):
        policy(one, other)


def test_a_profile_without_sandbox_env_dumps_as_before() -> None:
    compiled = profile("plain")
    assert "sandbox_env" not in compiled.model_dump(mode="json")
    assert "sandbox_env" in profile("env", sandbox_env={"A": "b"}).model_dump(mode="json")
