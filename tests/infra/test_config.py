"""Stack configuration: the examples validate, and every kind of mistake is reported as
`key: what is wrong`, never as a traceback."""

from __future__ import annotations

import copy
import runpy
from collections.abc import Callable, Iterator
from typing import Any

import pulumi
import pytest
from pulumi.runtime import config as runtime_config

from tests.infra.harness import ROOT, example_raw, example_stack, raw_of, run_program
from umbra.components.config import ConfigError, ConsoleStack, TeamStack, parse_stack_config
from umbra.components.program import run

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

Edit = Callable[[dict[str, Any]], None]


def _set(path: str, value: Any) -> Edit:
    def edit(doc: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = doc
        for p in parents:
            node = node[int(p)] if p.isdigit() else node[p]
        if value is _DELETE:
            del node[last]
        else:
            node[int(last) if last.isdigit() else last] = value

    return edit


_DELETE = object()


def test_example_stacks_validate() -> None:
    gcp = parse_stack_config(example_raw("acme-gcp"), frozenset())
    azure = parse_stack_config(example_raw("globex-azure"), frozenset())
    assert isinstance(gcp, TeamStack) and gcp.cloud == "gcp"
    assert [(d.name, d.cvms) for d in gcp.developers] == [
        ("alice", ["main", "scratch"]),
        ("bob", ["main"]),
    ]
    assert isinstance(azure, TeamStack) and azure.cloud == "azure"
    raw = example_raw("console-gcp") | {"umbra:consoleDbPassword": "x" * 24}
    console = parse_stack_config(raw, frozenset({"umbra:consoleDbPassword"}))
    assert isinstance(console, ConsoleStack)


@pytest.mark.parametrize(
    ("base", "edit", "expected"),
    [
        ("acme-gcp", _set("teem", "x"), "umbra:stack.teem: unknown key"),
        ("acme-gcp", _set("team", _DELETE), "umbra:stack.team: required key is missing"),
        ("acme-gcp", _set("team", "Acme!"), "umbra:stack.team: String should match pattern"),
        ("acme-gcp", _set("kind", "teams"), "umbra:stack: kind must be 'team' or 'console'"),
        (
            "acme-gcp",
            _set("developers.0.ssh_keys.0", "ssh-rsa"),
            "umbra:stack.developers[0].ssh_keys[0]: not an OpenSSH public key line: 'ssh-rsa'",
        ),
        (
            "acme-gcp",
            _set("network.ssh_ingress_cidrs", ["0.0.0.0/0"]),
            "umbra:stack.network.ssh_ingress_cidrs[0]: 0.0.0.0/0 opens the port to (nearly) the whole internet",
        ),
        (
            "acme-gcp",
            _set("network.security_cidr", "10.20.0.0/28"),
            "umbra:stack.network: dev_cidr 10.20.0.0/24 overlaps security_cidr 10.20.0.0/28",
        ),
        (
            "acme-gcp",
            _set("security_cvm.size", "n2d-standard-4"),
            "umbra:stack: security_cvm.size 'n2d-standard-4' is not a TDX machine type",
        ),
        (
            "acme-gcp",
            _set("gcp.zone", "europe-west4-a"),
            "umbra:stack.gcp: zone 'europe-west4-a' is not in region 'us-central1'",
        ),
        (
            "acme-gcp",
            _set("console_url", "http://console"),
            "umbra:stack.console_url: must be an https:// URL",
        ),
        (
            "acme-gcp",
            _set("developers.1.name", "alice"),
            "umbra:stack: developers listed twice: alice",
        ),
        (
            "globex-azure",
            _set("dev_cvm.size", "Standard_DC4as_v5"),
            "umbra:stack: dev_cvm.size 'Standard_DC4as_v5' is not a TDX size",
        ),
        (
            "globex-azure",
            _set("azure", _DELETE),
            "umbra:stack: cloud 'azure' needs an 'azure' block",
        ),
        (
            "globex-azure",
            _set("dev_cvm.image", "ubuntu-cvm"),
            "umbra:stack: dev_cvm.image 'ubuntu-cvm' is neither a resource id nor publisher:offer:sku:version",
        ),
    ],
)
def test_bad_config_names_the_key_and_the_problem(base: str, edit: Edit, expected: str) -> None:
    doc = copy.deepcopy(example_stack(base))
    edit(doc)
    with pytest.raises(ConfigError) as err:
        parse_stack_config(raw_of(doc), frozenset())
    assert expected in str(err.value), str(err.value)


def test_unknown_and_missing_top_level_keys() -> None:
    with pytest.raises(ConfigError, match=r"^umbra:stak: unknown key"):
        parse_stack_config({"umbra:stak": "{}"}, frozenset())
    with pytest.raises(ConfigError, match=r"^umbra:stack: required key is missing"):
        parse_stack_config({"gcp:project": "p"}, frozenset())
    with pytest.raises(ConfigError, match=r"^umbra:stack: must be a YAML mapping"):
        parse_stack_config({"umbra:stack": "acme"}, frozenset())


def test_console_password_must_be_a_secret() -> None:
    raw = example_raw("console-gcp")
    with pytest.raises(ConfigError, match=r"umbra:consoleDbPassword: required key is missing"):
        parse_stack_config(raw, frozenset())
    raw["umbra:consoleDbPassword"] = "correct horse battery staple"
    with pytest.raises(
        ConfigError, match=r"stored in plain text; set it with `pulumi config set --secret`"
    ):
        parse_stack_config(raw, frozenset())


@pytest.fixture
def stack_config() -> Iterator[Callable[[dict[str, str], list[str]], None]]:
    def set_config(raw: dict[str, str], secrets: list[str]) -> None:
        runtime_config.set_all_config(raw, secrets)

    yield set_config
    runtime_config.set_all_config({}, [])


def test_program_reports_a_bad_config_as_a_run_error(
    stack_config: Callable[[dict[str, str], list[str]], None],
) -> None:
    doc = example_stack("acme-gcp") | {"cloud": "aws"}
    stack_config(raw_of(doc), [])
    # RunError is what the engine prints as a plain message, without the Python traceback.
    with pytest.raises(pulumi.RunError) as err:
        run(ROOT)
    assert str(err.value) == (
        "stack configuration is invalid:\numbra:stack.cloud: Input should be 'gcp' or 'azure'"
    )


def test_infra_main_runs_the_example_team(
    stack_config: Callable[[dict[str, str], list[str]], None],
) -> None:
    stack_config(example_raw("acme-gcp"), [])
    mocks, _ = run_program(lambda: runpy.run_path(str(ROOT / "infra" / "__main__.py")))
    assert len(mocks.of_type("gcp:compute/instance:Instance")) == 4


def test_components_refuse_internet_wide_ssh_even_without_the_config_layer() -> None:
    from umbra.components.network import TeamNetworkArgs

    with pytest.raises(
        ValueError, match=r"ssh_ingress_cidrs: 0.0.0.0/0 would open SSH to the internet"
    ):
        TeamNetworkArgs(
            team="acme",
            cloud="azure",
            dev_cidr="10.0.0.0/24",
            security_cidr="10.0.1.0/28",
            ssh_ingress_cidrs=["0.0.0.0/0"],
            azure=None,
        )
