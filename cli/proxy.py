"""`umbra proxy`: run the Security CVM's egress proxy.

The options of `serve` are not declared here: they are built from `ProxyConfig`'s field
declarations (`umbra.proxy.config`), the one place an option's flag, type, default and help live.
"""

from __future__ import annotations

import asyncio
import inspect
import os
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from umbra.cli.output import fail
from umbra.proxy.config import Option, ProxyConfig, options

app = typer.Typer(help="The Security CVM's policy-enforcing egress proxy.", no_args_is_help=True)


def _listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise typer.BadParameter("expected HOST:PORT, e.g. 127.0.0.1:8080")
    return host.strip("[]"), int(port)


def _cli_type(option: Option) -> Any:
    """The command-line type of an option: HOST:PORT and choices are text, checked here."""
    if option.flag.port_field or option.choices:
        return str if option.default is not None else str | None
    annotation = option.annotation
    if getattr(annotation, "__origin__", None) is list:
        return annotation | None  # a repeatable option given no times is None
    return annotation


def _config_values(params: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of `ProxyConfig` from the command's parameters."""
    values: dict[str, Any] = {}
    for option in options():
        value = params[option.param]
        if option.field in ("security_cvm_id_file", "workers"):
            continue  # resolved by `serve` itself
        if option.flag.port_field:
            if value is not None:
                values[option.field], values[option.flag.port_field] = _listen(value)
        elif option.choices and value not in option.choices:
            *first, last = option.choices
            fail(f"{option.name} must be {', '.join(first)} or {last}", 2)
        elif value is None and getattr(option.annotation, "__origin__", None) is list:
            values[option.field] = []
        else:
            values[option.field] = value
    return values


def serve(**params: Any) -> None:
    """Run the proxy until interrupted."""
    from umbra.proxy.enroll import ensure_console_credential
    from umbra.proxy.runner import UmbraProxy
    from umbra.proxy.startup import StartupError
    from umbra.proxy.workers import WorkerSupervisor

    values = _config_values(params)
    id_file: Path | None = params["security_cvm_id_file"]
    if id_file is not None:
        if values.get("security_cvm_id") is not None:
            fail("give --security-cvm-id or its file, not both", 2)
        try:
            values["security_cvm_id"] = id_file.read_text().strip()
        except OSError as exc:
            fail(f"{id_file}: {exc.strerror}", 1)
    values["workers"] = params["workers"] or os.cpu_count() or 1
    try:
        config = ProxyConfig(**values)
    except ValidationError as exc:
        fail(exc.errors()[0]["msg"], 2)
    try:
        if ensure_console_credential(config):
            typer.echo(
                f"umbra proxy serve: enrolled; credential in {config.console_credential_file}"
            )
    except StartupError as exc:
        fail(str(exc), 1)
    if config.workers > 1:
        try:
            code = WorkerSupervisor(config).run()
        except StartupError as exc:
            fail(str(exc), 1)
        raise typer.Exit(code)
    proxy = UmbraProxy(config)
    try:
        asyncio.run(proxy.run())
    except StartupError as exc:
        fail(str(exc), 1)
    except KeyboardInterrupt:
        pass


def _typer_option(option: Option) -> Any:
    # A flag named after its parameter is left to typer, which then also makes `--no-X` of a bool.
    if option.name == "--" + option.param.replace("_", "-"):
        return typer.Option(help=option.flag.help)
    return typer.Option(option.name, help=option.flag.help)


serve.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [
        inspect.Parameter(
            option.param,
            inspect.Parameter.KEYWORD_ONLY,
            default=option.default,
            annotation=Annotated[_cli_type(option), _typer_option(option)],
        )
        for option in options()
    ]
)
app.command()(serve)
