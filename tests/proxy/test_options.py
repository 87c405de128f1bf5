"""The proxy's options are declared once (`umbra.proxy.config`): the command and the spec's table
are built from the declarations, and fail here when they diverge."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from umbra.cli.proxy import app
from umbra.proxy.config import ProxyConfig, options, with_spec_table

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "docs" / "specs" / "proxy.md"
# Fields that are configuration but not options: set by the supervisor or fixed intervals.
INTERNAL = {"secrets_interval", "poll_interval", "ship_interval", "worker_index"}


def test_spec_table_is_generated_from_the_declarations() -> None:
    text = SPEC.read_text()
    assert with_spec_table(text) == text, (
        "docs/specs/proxy.md's options table differs from proxy/config.py: run "
        "`.venv/bin/python -m umbra.proxy.config docs/specs/proxy.md`"
    )


def test_every_field_is_an_option_or_internal() -> None:
    covered = {option.field for option in options()}
    covered |= {option.flag.port_field for option in options() if option.flag.port_field}
    assert set(ProxyConfig.model_fields) - covered == INTERNAL


def test_command_options_are_the_declared_ones() -> None:
    command = get_command(app)
    declared = {option.name for option in options()}
    on_command = {opt for param in command.params for opt in param.opts}
    assert on_command - {"--help", "--install-completion", "--show-completion"} == declared
    # A bool keeps its negative form, as typer makes it.
    assert any("--no-secrets-from-console" in param.secondary_opts for param in command.params)


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        ([], 2, "error: Value error, give exactly one of --policy-dir, --bundle"),
        (["--bundle", "b.json"], 2, "--bundle and --console need at least one pinned --bundle-key"),
        (["--policy-dir", "p", "--quote-source", "tpm"], 2, "--quote-source must be configfs, "),
        (["--policy-dir", "p", "--listen", "nope"], 2, "expected HOST:PORT"),
        (
            ["--policy-dir", "p", "--security-cvm-id", "a", "--security-cvm-id-file", "f"],
            2,
            "give --security-cvm-id or its file, not both",
        ),
        (["--policy-dir", "p", "--security-cvm-id-file", "/nonexistent/u13a"], 1, "No such file"),
        (
            ["--policy-dir", "p", "--listen", "0.0.0.0:8080", "--tunnel-listen", "127.0.0.1:1"],
            2,
            "with --tunnel-listen, --listen must be a loopback address",
        ),
        (["--policy-dir", "p", "--workers", "2", "--listen", "127.0.0.1:0"], 2, "fixed --listen"),
        (["--policy-dir", "p", "--console-ca", "ca.pem"], 2, "--console-ca needs --console"),
    ],
)
def test_errors_are_precise(args: list[str], code: int, message: str) -> None:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == code, result.output
    assert message in result.output
    assert "Traceback" not in result.output
