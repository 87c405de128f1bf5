"""`umbra attest`: verify TDX quotes against a measurement policy; emit simulated quotes."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from rich.panel import Panel
from rich.table import Table

from umbra.attest.collateral import (
    Collateral,
    CollateralCache,
    CollateralSource,
    PccsCollateral,
    StaticCollateral,
)
from umbra.attest.errors import AttestError
from umbra.attest.eventlog import Event, dump_dstack_event_log, load_event_log
from umbra.attest.measurement import load_measurement_policy
from umbra.attest.quote import parse_quote
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx
from umbra.attest.verify import Verdict, Verifier, summarize
from umbra.cli.output import EXIT_FINDINGS, EXIT_USAGE, console, fail, print_json

app = typer.Typer(help="Verify TDX attestation quotes; simulate a TEE.", no_args_is_help=True)

JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")]
_HEX = re.compile(rb"^[0-9a-fA-F\s]+$")


def _read_quote(path: Path, as_json: bool) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        fail(f"cannot read {path}: {exc.strerror}", EXIT_USAGE, as_json=as_json)
    # Quotes travel as raw bytes or as hex text (dstack, cloud APIs); accept both.
    if data and _HEX.match(data):
        return bytes.fromhex(data.decode())
    return data


def _hex_arg(value: str | None, what: str, as_json: bool) -> bytes | None:
    if value is None:
        return None
    try:
        return bytes.fromhex(value)
    except ValueError:
        fail(f"{what} must be hex", EXIT_USAGE, as_json=as_json)


@app.command()
def verify(
    quote_file: Annotated[Path, typer.Argument(help="The quote: raw bytes or hex text.")],
    policy: Annotated[Path, typer.Option("--policy", "-p", help="Release manifest (YAML/JSON).")],
    binding: Annotated[
        Path | None, typer.Option("--binding", "-b", help="Instance binding written at launch.")
    ] = None,
    collateral: Annotated[
        Path | None, typer.Option("--collateral", "-c", help="Collateral JSON (dcap-qvl format).")
    ] = None,
    pccs: Annotated[
        list[str] | None,
        typer.Option("--pccs", help="PCCS URL to fetch collateral from; repeat to try in turn."),
    ] = None,
    cache_dir: Annotated[
        Path | None, typer.Option("--cache-dir", help="Persist fetched collateral here.")
    ] = None,
    event_log: Annotated[
        Path | None, typer.Option("--event-log", "-e", help="dstack JSON or binary CCEL log.")
    ] = None,
    report_data: Annotated[
        str | None, typer.Option("--report-data", help="Expected report_data (128 hex digits).")
    ] = None,
    at: Annotated[
        int | None, typer.Option("--at", help="Verify as of this Unix time (default: now).")
    ] = None,
    allow_simulated: Annotated[
        bool,
        typer.Option("--allow-simulated", help="Accept simulated quotes if the policy says so."),
    ] = False,
    simulated_root: Annotated[
        Path | None, typer.Option("--simulated-root", help="The simulated root CA (DER or PEM).")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Verify QUOTE_FILE and print the verdict with every reason it failed."""
    raw = _read_quote(quote_file, as_json)
    expected_rd = _hex_arg(report_data, "--report-data", as_json)
    if expected_rd is not None and len(expected_rd) != 64:
        fail("--report-data must be 64 bytes (128 hex digits)", EXIT_USAGE, as_json=as_json)
    try:
        measurement = load_measurement_policy(policy, binding)
        source = _collateral_source(collateral, pccs, cache_dir)
        log: list[Event] | None = None
        if event_log is not None:
            try:
                log = load_event_log(event_log.read_bytes())
            except OSError as exc:
                fail(f"cannot read {event_log}: {exc.strerror}", EXIT_USAGE, as_json=as_json)
        root = _load_root(simulated_root) if simulated_root else None
    except AttestError as exc:
        fail(str(exc), EXIT_USAGE, as_json=as_json)
    verdict = Verifier(measurement, source, allow_simulated, root).verify(
        raw, event_log=log, expected_report_data=expected_rd, now=at
    )
    if as_json:
        print_json(verdict.to_json())
    else:
        _render(verdict, quote_file)
    if not verdict.ok:
        raise typer.Exit(EXIT_FINDINGS)


def _collateral_source(
    path: Path | None, pccs: list[str] | None, cache_dir: Path | None
) -> CollateralSource:
    if path is not None and pccs:
        raise AttestError("give --collateral or --pccs, not both")
    if path is not None:
        return StaticCollateral(Collateral.from_file(path))
    if pccs:
        return PccsCollateral(pccs, cache=CollateralCache(cache_dir))
    raise AttestError("collateral needed: give --collateral FILE or --pccs URL")


def _load_root(path: Path) -> bytes:
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import Encoding

    try:
        data = path.read_bytes()
        cert = (
            x509.load_pem_x509_certificate(data)
            if data.startswith(b"-----")
            else x509.load_der_x509_certificate(data)
        )
    except (OSError, ValueError) as exc:
        raise AttestError(f"cannot load simulated root {path}: {exc}") from None
    return cert.public_bytes(Encoding.DER)


def _table() -> Table:
    table = Table(show_header=False, box=None)
    table.add_column(no_wrap=True)
    table.add_column(overflow="fold")  # measurements are long hex: wrap, never truncate
    return table


def _render(v: Verdict, source: Path) -> None:
    if v.simulated:
        why = (
            "Accepted only because the policy says tee: simulated and you passed --allow-simulated."
            if v.ok
            else "The policy is for a simulated TEE."
        )
        console.print(
            Panel(
                "[bold]SIMULATED TEE[/] - this quote proves nothing about real hardware.\n" + why,
                style="bold magenta",
            )
        )
    title = "[bold green]PASS[/]" if v.ok else "[bold red]FAIL[/]"
    table = _table()
    table.add_row("quote", str(source))
    table.add_row("TCB status", v.tcb_status or "-")
    if v.advisory_ids:
        table.add_row("advisories", ", ".join(v.advisory_ids))
    for key in ("mr_td", "rtmr0", "rtmr1", "rtmr2", "rtmr3"):
        if key in v.quote:
            table.add_row(key.upper(), v.quote[key])
    if v.events_checked:
        table.add_row("events", ", ".join(v.events_checked))
    table.add_row("verified at", str(v.verified_at))
    console.print(Panel(table, title=title, border_style="green" if v.ok else "red"))
    for reason in v.reasons:
        console.print(f"[red]✗[/] {reason}", highlight=False, soft_wrap=True)


@app.command()
def parse(
    quote_file: Annotated[Path, typer.Argument(help="The quote: raw bytes or hex text.")],
    as_json: JsonFlag = False,
) -> None:
    """Parse QUOTE_FILE (no verification) and show its measurements."""
    raw = _read_quote(quote_file, as_json)
    try:
        summary = summarize(parse_quote(raw))
    except AttestError as exc:
        fail(str(exc), EXIT_FINDINGS, as_json=as_json)
    if as_json:
        print_json(summary)
        return
    table = _table()
    for key, value in summary.items():
        table.add_row(key, str(value))
    console.print(Panel(table, title="quote (unverified)"))


@app.command()
def simulate(
    out_dir: Annotated[Path, typer.Argument(help="Directory to write the bundle into.")],
    pki_dir: Annotated[
        Path, typer.Option("--pki", help="Simulated PKI directory (created if missing).")
    ] = Path(".umbra/simulated-pki"),
    report_data: Annotated[str, typer.Option("--report-data", help="Hex, up to 64 bytes.")] = "",
    event: Annotated[
        list[str] | None,
        typer.Option("--event", help="Runtime event NAME=HEXPAYLOAD extended into RTMR3."),
    ] = None,
    version: Annotated[int, typer.Option("--version", help="Quote version: 4 or 5.")] = 4,
    image: Annotated[str, typer.Option("--image", help="Simulated image name.")] = "umbra-dev-cvm",
    at: Annotated[int | None, typer.Option("--at", help="Collateral issue time.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Emit a SIMULATED quote plus its collateral, event log, release manifest and root CA."""
    rd = _hex_arg(report_data, "--report-data", as_json) or b""
    try:
        pki = SimulatedPki.load_or_create(pki_dir)
        tdx = SimulatedTdx(pki, image=image, version=version)
        names: list[dict[str, Any]] = []
        for spec in event or []:
            name, sep, payload = spec.partition("=")
            if not sep or not name:
                raise AttestError(f"--event {spec!r}: expected NAME=HEXPAYLOAD")
            value = _hex_arg(payload, f"--event {name}", as_json) or b""
            tdx.extend_runtime_event(name, value)
            names.append({"name": name, "payloads": [value.hex()]})
        quote = tdx.quote(rd)
        issued = (int(time.time()) if at is None else at) - 60
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "quote").write_bytes(quote)
        (out_dir / "collateral.json").write_text(pki.collateral(issued).json_text)
        (out_dir / "event_log.json").write_text(dump_dstack_event_log(tdx.event_log()))
        (out_dir / "root.der").write_bytes(pki.root_der)
        manifest = tdx.release_manifest(events=names).model_dump(mode="json")
        (out_dir / "release.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    except (AttestError, OSError) as exc:
        fail(str(exc), EXIT_USAGE, as_json=as_json)
    files = ["quote", "collateral.json", "event_log.json", "root.der", "release.yaml"]
    if as_json:
        print_json({"ok": True, "simulated": True, "files": [str(out_dir / f) for f in files]})
        return
    console.print("[bold magenta]SIMULATED[/] quote written to " + str(out_dir))
    console.print(
        f"verify with: umbra attest verify {out_dir}/quote -p {out_dir}/release.yaml "
        f"-c {out_dir}/collateral.json -e {out_dir}/event_log.json "
        f"--allow-simulated --simulated-root {out_dir}/root.der",
        highlight=False,
        soft_wrap=True,
    )
