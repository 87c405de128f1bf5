"""`umbra up`'s package: one module a concern, its names importable from `umbra.cli.up_stack`,
its ports and components stated once, and the Console's environment spelt by setting name."""

from __future__ import annotations

import re
from pathlib import Path

from umbra.cli import up_stack
from umbra.console import config

PACKAGE = Path(up_stack.__file__).parent


def test_every_exported_name_resolves() -> None:
    assert all(hasattr(up_stack, name) for name in up_stack.__all__)


def test_ports_are_consecutive_offsets_and_each_has_an_owner() -> None:
    assert sorted(up_stack.PORTS.values()) == list(range(8))
    stack = up_stack.Stack(Path("/nonexistent"), 7080)
    assert stack.port(up_stack.Port.TUNNEL) == stack.port("tunnel") == 7083
    assert stack.console_url == "http://127.0.0.1:7081"
    assert {port.owner for port in up_stack.Port} == set(up_stack.Component)


def test_console_env_names_only_settings_the_console_knows(tmp_path: Path) -> None:
    env = up_stack.console_env(up_stack.Stack(tmp_path, 7080))
    assert len(env) == 14 and all(name.startswith(config.ENV_PREFIX) for name in env)
    config._refuse_unknown(env)  # raises ConfigError naming a misspelt one


def test_no_console_variable_is_spelt_out_in_the_package() -> None:
    spelt = [
        f"{path.name}:{n}"
        for path in PACKAGE.glob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"UMBRA_CONSOLE_[A-Z]", line)
    ]
    assert spelt == []


def test_status_table_health_follows_the_probe() -> None:
    health = up_stack.component_health
    assert health({"running": True, "healthy": True}) is up_stack.Health.HEALTHY
    assert health({"running": True, "healthy": False}) is up_stack.Health.UNHEALTHY
    assert health({"running": False, "healthy": False}) is up_stack.Health.NOT_RUNNING


def test_no_module_of_the_package_is_large() -> None:
    sizes = {path.name: len(path.read_text().splitlines()) for path in PACKAGE.glob("*.py")}
    assert max(sizes.values()) < 300, sizes


def test_status_colours_every_health() -> None:
    from umbra.cli.up import _COLOUR

    assert set(_COLOUR) == set(up_stack.Health)
