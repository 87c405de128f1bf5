"""Loading policy files: every error names file, line and field; nothing loads partially."""

from __future__ import annotations

from pathlib import Path

import pytest

from umbra.policy.errors import PolicyError
from umbra.policy.loader import load_policy_dir

HEADER = "apiVersion: umbra/v1\nkind: Profile\n"


def write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(text)
    return path


def issues_of(directory: Path) -> list[tuple[str, int | None, str, str]]:
    with pytest.raises(PolicyError) as excinfo:
        load_policy_dir(directory)
    return [(Path(i.file).name, i.line, i.field, i.message) for i in excinfo.value.issues]


def test_a_bad_method_is_reported_at_its_line_and_field(tmp_path: Path) -> None:
    write(
        tmp_path,
        "p.yaml",
        HEADER
        + "name: p\negress:\n  - allow:\n      hosts: [x.com]\n      methods:\n        - GET\n        - FETCH\n",
    )
    [(file, line, field, message)] = issues_of(tmp_path)
    assert (file, line, field) == ("p.yaml", 9, "egress[0].allow.methods[1]")
    assert "GET" in message


def test_duplicate_keys_are_an_error_not_a_silent_override(tmp_path: Path) -> None:
    write(
        tmp_path, "p.yaml", HEADER + "name: p\negress:\n  - allow: {hosts: [x.com]}\negress: []\n"
    )
    [(file, line, _, message)] = issues_of(tmp_path)
    assert file == "p.yaml" and line == 6
    assert "duplicate key 'egress'" in message and "line 4" in message


def test_unknown_fields_are_refused(tmp_path: Path) -> None:
    write(
        tmp_path,
        "p.yaml",
        HEADER + "name: p\negress:\n  - allow: {hosts: [x.com], hots: [y.com]}\n",
    )
    [(_, line, field, message)] = issues_of(tmp_path)
    assert (line, field) == (5, "egress[0].allow.hots")
    assert "Extra inputs are not permitted" in message


def test_errors_from_every_file_are_collected(tmp_path: Path) -> None:
    write(tmp_path, "a.yaml", HEADER + "name: a\negress:\n  - allow: {hosts: ['*.x.*']}\n")
    write(
        tmp_path,
        "b.yaml",
        HEADER
        + "name: b\ninject:\n  - {header: Host, format: '{secret}', secret: team/x, hosts: [x.com]}\n",
    )
    write(tmp_path, "c.yaml", "apiVersion: umbra/v2\nkind: Profile\nname: c\n")
    write(tmp_path, "d.yaml", "key: [unclosed\n")
    found = issues_of(tmp_path)
    by_file = {file: (line, field, message) for file, line, field, message in found}
    assert by_file["a.yaml"][1] == "egress[0].allow.hosts[0]" and "wildcard" in by_file["a.yaml"][2]
    assert by_file["b.yaml"][1] == "inject[0].header" and "framing" in by_file["b.yaml"][2]
    assert by_file["c.yaml"][:2] == (1, "apiVersion")
    assert by_file["d.yaml"][0] == 2


@pytest.mark.parametrize(
    ("egress", "field", "fragment"),
    [
        ("- allow: {hosts: ['*']}", "egress[0]", "deny rules only"),
        ("- {allow: {hosts: [x.com]}, deny: {hosts: [y.com]}}", "egress[0]", "exactly one"),
        ("- allow: {hosts: []}", "egress[0].allow.hosts", "at least 1"),
        (
            "- allow: {hosts: [x.com], paths: ['/a/../b']}",
            "egress[0].allow.paths[0]",
            "canonical form",
        ),
        (
            "- allow: {hosts: [x.com], paths: ['/a/b**']}",
            "egress[0].allow.paths[0]",
            "whole path segment",
        ),
        (
            "- allow: {hosts: [x.com], ports: [0]}",
            "egress[0].allow.ports[0]",
            "greater than or equal to 1",
        ),
        ("- allow: {hosts: [x.com], ports: ['443']}", "egress[0].allow.ports[0]", "integer"),
        (
            "- allow: {hosts: [x.com], schemes: [ftp]}",
            "egress[0].allow.schemes[0]",
            "'https' or 'http'",
        ),
        (
            "- tunnel: {hosts: ['*.github.com'], ports: [22]}",
            "egress[0].tunnel.hosts[0]",
            "exact host",
        ),
        ("- tunnel: {hosts: [github.com]}", "egress[0].tunnel.ports", "Field required"),
        ("- id: Bad_Id\n    allow: {hosts: [x.com]}", "egress[0].id", "lowercase"),
    ],
)
def test_egress_rule_errors(tmp_path: Path, egress: str, field: str, fragment: str) -> None:
    write(tmp_path, "p.yaml", HEADER + f"name: p\negress:\n  {egress}\n")
    [(_, line, actual_field, message)] = issues_of(tmp_path)
    assert actual_field == field
    assert line == 5
    assert fragment in message


@pytest.mark.parametrize(
    ("rule", "field", "fragment"),
    [
        ("{id: a, regex: '(?<=x)y'}", "scan[0].regex", "look-around"),
        ("{id: a, regex: '(a)\\\\1'}", "scan[0].regex", "back-references"),
        ("{id: a, regex: '[unclosed'}", "scan[0].regex", "invalid regex"),
        ("{id: a, regex: 'x*'}", "scan[0].regex", "empty string"),
    ],
)
def test_scan_rule_errors(tmp_path: Path, rule: str, field: str, fragment: str) -> None:
    write(tmp_path, "p.yaml", HEADER + f"name: p\nscan:\n  - {rule}\n")
    [(_, _, actual_field, message)] = issues_of(tmp_path)
    assert (actual_field, fragment in message) == (field, True)


@pytest.mark.parametrize(
    ("rule", "field", "fragment"),
    [
        (
            "{header: Authorization, format: 'Bearer', secret: team/x, hosts: [x.com]}",
            "inject[0].format",
            "exactly one",
        ),
        (
            "{header: Authorization, format: '{secret}{secret}', secret: team/x, hosts: [x.com]}",
            "inject[0].format",
            "exactly one",
        ),
        (
            "{header: Authorization, format: '{secret} }', secret: team/x, hosts: [x.com]}",
            "inject[0].format",
            "brace",
        ),
        (
            "{header: Authorization, format: '{secret}', secret: org/x, hosts: [x.com]}",
            "inject[0].secret",
            "team/NAME",
        ),
        (
            "{header: Transfer-Encoding, format: '{secret}', secret: team/x, hosts: [x.com]}",
            "inject[0].header",
            "hop-by-hop",
        ),
        (
            "{header: 'Bad Header', format: '{secret}', secret: team/x, hosts: [x.com]}",
            "inject[0].header",
            "header name",
        ),
        (
            "{header: X-Key, format: '{secret}', secret: team/x, hosts: ['*.x.com']}",
            "inject[0].hosts[0]",
            "exact host",
        ),
        (
            "{header: X-Key, format: '{secret}', secret: team/x, hosts: [x.com], ports: []}",
            "inject[0].ports",
            "at least 1",
        ),
        (
            "{header: X-Key, format: '{secret}', secret: team/x, hosts: [x.com], ports: ['443']}",
            "inject[0].ports[0]",
            "integer",
        ),
        (
            "{header: X-Key, format: '{secret}', query: key, secret: team/x, hosts: [x.com]}",
            "inject[0]",
            "exactly one of 'header', 'headers', 'query', 'basic' or 'sigv4'",
        ),
        ("{secret: team/x, hosts: [x.com]}", "inject[0]", "exactly one of"),
        ("{header: X-Key, secret: team/x, hosts: [x.com]}", "inject[0]", "go together"),
        ("{query: 'api key', secret: team/x, hosts: [x.com]}", "inject[0].query", "query"),
        ("{query: 'k&x=1', secret: team/x, hosts: [x.com]}", "inject[0].query", "query"),
        (
            "{basic: {user: a, user_secret: team/u}, secret: team/x, hosts: [x.com]}",
            "inject[0].basic",
            "exactly one of 'user' or 'user_secret'",
        ),
        ("{basic: {user: 'a:b'}, secret: team/x, hosts: [x.com]}", "inject[0].basic.user", "':'"),
        ("{basic: {user: 'a}b'}, secret: team/x, hosts: [x.com]}", "inject[0].basic.user", "brace"),
        (
            "{basic: {user_secret: x}, secret: team/x, hosts: [x.com]}",
            "inject[0].basic.user_secret",
            "team/NAME",
        ),
        (
            "{headers: [{header: X-A, format: '{secret}'}, {header: x-a, format: 'k={secret}'}],"
            " secret: team/x, hosts: [x.com]}",
            "inject[0].headers",
            "one header twice",
        ),
        (
            "{headers: [{header: Host, format: '{secret}'}], secret: team/x, hosts: [x.com]}",
            "inject[0].headers[0].header",
            "hop-by-hop",
        ),
        (
            "{header: Authorization, format: 'Basic {basic}', secret: team/x, hosts: [x.com]}",
            "inject[0].format",
            "user_secret",
        ),
        (
            "{query: key, secret: team/x, hosts: [x.com], paths: ['/a/../b']}",
            "inject[0].paths[0]",
            "canonical",
        ),
        (
            "{query: key, secret: team/x, hosts: [x.com], paths: []}",
            "inject[0].paths",
            "at least 1",
        ),
    ],
)
def test_inject_rule_errors(tmp_path: Path, rule: str, field: str, fragment: str) -> None:
    write(tmp_path, "p.yaml", HEADER + f"name: p\ninject:\n  - {rule}\n")
    [(_, _, actual_field, message)] = issues_of(tmp_path)
    assert actual_field == field
    assert fragment in message


def test_duplicate_rule_ids_point_at_the_second(tmp_path: Path) -> None:
    write(
        tmp_path,
        "p.yaml",
        HEADER
        + "name: p\negress:\n  - id: a\n    allow: {hosts: [x.com]}\n  - id: a\n    deny: {hosts: [y.com]}\n",
    )
    [(_, line, field, message)] = issues_of(tmp_path)
    assert (line, field) == (7, "egress[1].id")
    assert "duplicate rule id 'p:a'" in message


def test_a_profile_name_defined_twice_is_an_error(tmp_path: Path) -> None:
    write(tmp_path, "a.yaml", HEADER + "name: same\n")
    write(tmp_path, "b.yaml", HEADER + "name: same\n")
    [(file, line, field, message)] = issues_of(tmp_path)
    assert (file, line, field) == ("b.yaml", 3, "name")
    assert "a.yaml" in message


def test_the_reserved_builtin_name_is_refused(tmp_path: Path) -> None:
    write(tmp_path, "a.yaml", HEADER + "name: builtin\n")
    [(_, _, field, message)] = issues_of(tmp_path)
    assert field == "name" and "reserved" in message


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (b"\xff\xfe", "not UTF-8"),
        (b"--- {a: 1}\n--- {b: 2}\n", "one YAML document"),
        (b"- a\n- b\n", "mapping"),
        (b"apiVersion: umbra/v1\nkind: Secret\n", "must be one of"),
        (
            b"apiVersion: umbra/v1\nkind: Profile\nname: !!python/object:os.system x\n",
            "python/object",
        ),
        (b"apiVersion: umbra/v1\nkind: Profile\n? [a, b]\n: c\n", "must be strings"),
    ],
)
def test_malformed_files(tmp_path: Path, content: bytes, fragment: str) -> None:
    (tmp_path / "p.yaml").write_bytes(content)
    [(_, _, _, message)] = issues_of(tmp_path)
    assert fragment in message


def test_a_valid_directory_loads_profiles_and_suites(tmp_path: Path) -> None:
    write(tmp_path, "p.yaml", HEADER + "name: p\negress:\n  - allow: {hosts: [x.com]}\n")
    (tmp_path / "tests").mkdir()
    write(
        tmp_path / "tests",
        "t.yml",
        "apiVersion: umbra/v1\nkind: PolicyTest\nname: t\nprofiles: [p]\ncases:\n  - {request: GET https://x.com/, expect: allow}\n",
    )
    loaded = load_policy_dir(tmp_path)
    assert sorted(loaded.profiles) == ["p"]
    assert [s.suite.name for s in loaded.suites] == ["t"]
    assert loaded.suites[0].case_lines == [6]


def test_an_injection_for_a_port_no_rule_allows_points_at_the_rule(tmp_path: Path) -> None:
    """The old demo profile: an allow on port 7443 and an injection without ports (443)."""
    write(
        tmp_path,
        "demo.yaml",
        HEADER
        + "name: demo\negress:\n  - allow: {hosts: [api.demo.test], ports: [7443]}\n"
        + "inject:\n  - id: token\n    header: Authorization\n    format: 'Bearer {secret}'\n"
        + "    secret: team/demo\n    hosts: [api.demo.test]\n",
    )
    with pytest.raises(PolicyError) as excinfo:
        load_policy_dir(tmp_path).compose_all()
    [issue] = excinfo.value.issues
    assert (Path(issue.file).name, issue.line, issue.field) == ("demo.yaml", 7, "demo:token")
    assert "on port 443, which no HTTPS allow rule of its profile reaches" in issue.message


@pytest.mark.parametrize(
    ("entry", "field", "fragment"),
    [
        ("{deny: {hosts: [x.com]}, push_refs: ['refs/heads/**']}", "egress[0]", "allow"),
        ("{allow: {hosts: [x.com]}, push_refs: ['heads/main']}", "egress[0].push_refs[0]", "refs/"),
        (
            "{allow: {hosts: [x.com]}, push_refs: ['refs/heads/a**']}",
            "egress[0].push_refs[0]",
            "whole",
        ),
        ("{allow: {hosts: [x.com]}, push_refs: ['refs/../x']}", "egress[0].push_refs[0]", ".."),
    ],
)
def test_push_ref_errors(tmp_path: Path, entry: str, field: str, fragment: str) -> None:
    write(tmp_path, "p.yaml", HEADER + f"name: p\negress:\n  - {entry}\n")
    [(_, line, actual_field, message)] = issues_of(tmp_path)
    assert (line, actual_field) == (5, field)
    assert fragment in message


def test_policy_test_cases_check_pushes_by_ref(tmp_path: Path) -> None:
    from umbra.policy.runner import run_suites

    write(
        tmp_path,
        "p.yaml",
        HEADER
        + "name: p\negress:\n  - id: push\n    allow: {hosts: [git.x.com], methods: [POST]}\n"
        + "    push_refs: ['refs/heads/agent/**']\n",
    )
    write(
        tmp_path,
        "t.yaml",
        "apiVersion: umbra/v1\nkind: PolicyTest\nname: t\nprofiles: [p]\ncases:\n"
        + "  - {request: POST https://git.x.com/r.git/git-receive-pack, push: [refs/heads/agent/1],"
        + " expect: allow}\n"
        + "  - {request: POST https://git.x.com/r.git/git-receive-pack, push: [refs/heads/main],"
        + " expect: deny, reason: push_ref_denied, rule: 'p:push'}\n",
    )
    results = run_suites(load_policy_dir(tmp_path))
    assert [result.passed for result in results] == [True, True], results


def test_conflicting_placements_name_file_line_and_field(tmp_path: Path) -> None:
    """Two rules placing the same query parameter (or header, any case) on one host and port
    do not compose, whatever their paths; `umbra policy check` reports the second rule."""
    write(
        tmp_path,
        "p.yaml",
        HEADER
        + "name: p\negress:\n  - allow: {hosts: [x.com]}\ninject:\n"
        + "  - {id: a, query: key, secret: team/a, hosts: [x.com], paths: ['/v1/**']}\n"
        + "  - {id: b, query: key, secret: team/b, hosts: [x.com], paths: ['/v2/**']}\n"
        + "  - {id: c, basic: {user: u}, secret: team/c, hosts: [x.com]}\n"
        + "  - id: d\n    headers: [{header: authorization, format: 'Bearer {secret}'}]\n"
        + "    secret: team/d\n    hosts: [x.com]\n"
        + "  - {id: e, header: X-K, format: '{secret}', secret: team/e, hosts: [x.com]}\n"
        + "  - {id: f, basic: {user: v}, secret: team/f, hosts: [x.com]}\n",
    )
    policy_set = load_policy_dir(tmp_path)
    with pytest.raises(PolicyError) as excinfo:
        policy_set.compose(["p"])
    found = [(Path(i.file).name, i.line, i.field, i.message) for i in excinfo.value.issues]
    assert found == [
        (
            "p.yaml",
            8,
            "p:b: inject[1].query",
            "injects query parameter 'key' for x.com:443, as p:a already does",
        ),
        (
            "p.yaml",
            10,
            "p:d: inject[3].headers",
            "injects header 'authorization' for x.com:443, as p:c already does",
        ),
        (
            "p.yaml",
            15,
            "p:f: inject[5].basic",
            "injects header 'Authorization' for x.com:443, as p:c already does",
        ),
    ]
