"""Rendering is deterministic and every rendered file passes, and is held to, the structural rules."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from umbra.sandbox.render import render_security_cvm
from umbra.sandbox.validate import (
    ComposeError,
    validate_security_compose,
)

from .fixtures import security_definition


def test_security_topology_as_rendered() -> None:
    doc = yaml.safe_load(render_security_cvm(security_definition().compose).text)
    services = doc["services"]
    assert set(services) == {"proxy"}
    assert services["proxy"]["ports"] == ["8443:8443/tcp"]
    command = services["proxy"]["command"]
    assert command[command.index("--listen") + 1] == "127.0.0.1:8080"
    assert command[command.index("--tunnel-listen") + 1] == "0.0.0.0:8443"
    assert "BEGIN PUBLIC KEY" in doc["configs"]["bundle_keys"]["content"]


def test_security_services_run_commands_that_exist() -> None:
    """Every argument of the rendered command parses with the real `umbra proxy serve`."""
    from typer.main import get_command
    from typer.testing import CliRunner

    from umbra.cli.app import app
    from umbra.cli.proxy import app as proxy_app

    doc = yaml.safe_load(render_security_cvm(security_definition().compose).text)
    group = get_command(proxy_app)
    for svc in doc["services"].values():
        command = svc["command"]
        assert command[:3] == ["umbra", "proxy", "serve"]
        listing = CliRunner().invoke(app, ["proxy", "--help"])
        assert listing.exit_code == 0 and " serve " in listing.output
        # `umbra proxy` has one command, so typer makes the app that command itself.
        params = group.make_context("serve", list(command[3:])).params
        assert params["tunnel_listen"] == "0.0.0.0:8443"
        assert params["console"] == "https://console.example"
        assert params["quote_source"] == "configfs"
        assert params["listen"] == "127.0.0.1:8080"


def _mutate(text: str, change: Any) -> str:
    doc = yaml.safe_load(text)
    change(doc)
    return yaml.safe_dump(doc, sort_keys=False)


def _bind(device: str) -> dict[str, str]:
    return {"type": "none", "o": "bind", "device": device}


def _set(path: list[str], value: Any) -> Any:
    def go(doc: Any) -> None:
        for key in path[:-1]:
            doc = doc[key]
        doc[path[-1]] = value

    return go


def test_security_validator_refuses_publishing_proxy() -> None:
    text = render_security_cvm(security_definition().compose).text
    bad = _mutate(text, _set(["services", "proxy", "ports"], ["8443:8443/tcp", "8080:8080/tcp"]))
    with pytest.raises(ComposeError, match="publishes only the tunnel endpoint"):
        validate_security_compose(bad)


def test_security_validator_refuses_a_reachable_proxy_listener() -> None:
    text = render_security_cvm(security_definition().compose).text

    def widen(doc: Any) -> None:
        command = doc["services"]["proxy"]["command"]
        command[command.index("--listen") + 1] = "0.0.0.0:8080"

    with pytest.raises(ComposeError, match="--listen must be a loopback address"):
        validate_security_compose(_mutate(text, widen))


def test_security_validator_confines_the_tsm_mount() -> None:
    text = render_security_cvm(security_definition().compose).text

    def remount(doc: Any) -> None:
        doc["services"]["proxy"]["volumes"].append("/sys/kernel/config:/sys/kernel/config")

    with pytest.raises(ComposeError, match="host path /sys/kernel/config is not under"):
        validate_security_compose(_mutate(text, remount))


_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=12))
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    path=st.lists(st.sampled_from(["services", "proxy", "networks", "edge", "configs", "content", "volumes", "ports", "cap_add", "ipam", "config", "subnet", "command"]), min_size=1, max_size=4),
    value=_values,
)  # fmt: skip
def test_any_mangled_compose_is_refused_or_valid_never_a_crash(path: list[str], value: Any) -> None:
    doc: Any = yaml.safe_load(_SECURITY_TEXT)
    node = doc
    for key in path[:-1]:
        if not isinstance(node, dict):
            break
        node = node.setdefault(key, {})
    if isinstance(node, dict):
        node[path[-1]] = value
    problems: list[str] = []
    try:
        validate_security_compose(yaml.safe_dump(doc))
    except ComposeError as exc:  # the only failure allowed, and it must say what is wrong
        problems = exc.problems or [""]
    assert all(isinstance(p, str) and p for p in problems)


_SECURITY_TEXT = render_security_cvm(security_definition().compose).text


def test_duplicate_keys_are_refused() -> None:
    text = _SECURITY_TEXT.replace("name: ", "name: x\nname: ", 1)
    with pytest.raises(ComposeError, match="duplicate key 'name'"):
        validate_security_compose(text)


def test_no_dev_compose_and_no_sysbox_remain() -> None:
    """The Dev CVM's measured document is its host definition (test_dev_definition.py): the
    sysbox compose template, its validator and `runtime: sysbox-runc` are gone."""
    from importlib import resources

    import umbra.sandbox.validate as validate

    templates = resources.files("umbra.sandbox").joinpath("templates")
    assert sorted(p.name for p in templates.iterdir()) == ["security-cvm.compose.yaml.j2"]
    assert not hasattr(validate, "validate_dev_compose")
    assert "sysbox" not in inspect.getsource(validate)


def test_the_security_spool_binds_the_data_disk_and_nothing_else() -> None:
    """Fails before the fix: the spool was a plain Docker volume on tmpfs, lost by every reboot."""
    from umbra.sandbox.validate import SPOOL_DIR, SPOOL_VOLUME

    text = render_security_cvm(security_definition().compose).text
    assert yaml.safe_load(text)["volumes"]["spool"] == SPOOL_VOLUME
    assert SPOOL_DIR == "/var/lib/umbra/data/spool"

    def tmpfs(doc: Any) -> None:
        doc["volumes"]["spool"] = {}

    with pytest.raises(ComposeError, match="volume spool must bind the data disk"):
        validate_security_compose(_mutate(text, tmpfs))

    def elsewhere(doc: Any) -> None:
        doc["volumes"]["spool"]["driver_opts"]["device"] = "/etc"

    with pytest.raises(ComposeError, match="the spool may bind exactly /var/lib/umbra/data/spool"):
        validate_security_compose(_mutate(text, elsewhere))

    def policy_bind(doc: Any) -> None:
        doc["volumes"]["policy"] = SPOOL_VOLUME

    with pytest.raises(ComposeError, match="volume policy: only a plain volume"):
        validate_security_compose(_mutate(text, policy_bind))
