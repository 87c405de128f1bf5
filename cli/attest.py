"""`umbra attest`: verify TDX quotes against a measurement policy; emit simulated quotes."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
import yaml
from pydantic import ValidationError
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from umbra.attest.azure import decode_envelope, is_azure_envelope, parse_hcl_report
from umbra.attest.errors import AttestError
from umbra.attest.eventlog import Event, dump_dstack_event_log, load_event_log
from umbra.attest.inputs import decode_evidence
from umbra.attest.measurement import MeasurementPolicy, ReleaseManifest, load_measurement_policy
from umbra.attest.policy_from import release_from_evidence
from umbra.attest.quote import parse_quote
from umbra.cli.output import EXIT_FINDINGS, EXIT_USAGE, console, fail, print_json

if TYPE_CHECKING:  # collateral, verification and the simulator load dcap-qvl: not for --help
    from umbra.attest.collateral import CollateralSource
    from umbra.attest.verify import Verdict

app = typer.Typer(help="Verify TDX attestation quotes; simulate a TEE.", no_args_is_help=True)

JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")]
# Fresh collateral by default: Intel's PCS, or the PCCS an operator names in this variable.
PCCS_ENV = "UMBRA_PCCS_URL"
INTEL_PCS_URL = "https://api.trustedservices.intel.com"
EXPIRED_HINT = " (use fresh collateral, or --at for old vectors)"


def _read_quote(path: Path, as_json: bool) -> bytes:
    """Raw bytes, hex (0x, whitespace) or base64 of a quote or Azure evidence that parses;
    else one line and EXIT_USAGE, the one exit code of every command for "not a quote"."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        fail(f"cannot read {path}: {exc.strerror}", EXIT_USAGE, as_json=as_json)
    try:
        raw = decode_evidence(data)
        _parse_evidence(raw)
    except AttestError as exc:
        fail(f"{path}: {exc}", EXIT_USAGE, as_json=as_json)
    return raw


def _parse_evidence(raw: bytes) -> None:
    """Raises QuoteParseError naming the field and offset where `raw` stops being evidence."""
    if is_azure_envelope(raw):
        envelope = decode_envelope(raw)
        parse_hcl_report(envelope.hcl_report)
        raw = envelope.td_quote
    parse_quote(raw)


def _hex_arg(value: str | None, what: str, as_json: bool) -> bytes | None:
    """Hex as quotes take it: an optional 0x, any whitespace."""
    if value is None:
        return None
    text = "".join(value.split())
    try:
        return bytes.fromhex(text[2:] if text[:2] in ("0x", "0X") else text)
    except ValueError:
        fail(f"{what} must be hex", EXIT_USAGE, as_json=as_json)


def _at_arg(at: int | None, as_json: bool) -> None:
    # Checked here, not by typer's min=0, so that --json still gets one JSON line.
    if at is not None and at < 0:
        fail(f"--at must be a Unix time (seconds, >= 0), not {at}", EXIT_USAGE, as_json=as_json)


@app.command()
def verify(
    quote_file: Annotated[
        Path, typer.Argument(help="Quote or Azure evidence: raw, hex or base64.")
    ],
    policy: Annotated[
        Path | None,
        typer.Option(
            "--policy",
            "-p",
            help="Release manifest (YAML/JSON). Without it: DCAP and TCB checks only, and the "
            "measurements are printed as a policy to review and paste.",
        ),
    ] = None,
    binding: Annotated[
        Path | None, typer.Option("--binding", "-b", help="Instance binding written at launch.")
    ] = None,
    collateral: Annotated[
        Path | None, typer.Option("--collateral", "-c", help="Collateral JSON (dcap-qvl format).")
    ] = None,
    pccs: Annotated[
        list[str] | None,
        typer.Option(
            "--pccs",
            help=f"PCCS URL to fetch collateral from; repeat to try in turn "
            f"(default: ${PCCS_ENV}, else Intel PCS).",
        ),
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
        int | None,
        typer.Option("--at", help="Verify as of this Unix time (default: now)."),
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
    _at_arg(at, as_json)
    raw = _read_quote(quote_file, as_json)
    expected_rd = _hex_arg(report_data, "--report-data", as_json)
    if expected_rd is not None and len(expected_rd) != 64:
        fail("--report-data must be 64 bytes (128 hex digits)", EXIT_USAGE, as_json=as_json)
    if policy is None and binding is not None:
        fail("--binding needs --policy", EXIT_USAGE, as_json=as_json)
    pinned: ReleaseManifest | None = None
    try:
        if policy is not None:
            measurement = load_measurement_policy(policy, binding)
        else:
            pinned = _pinned(raw, allow_simulated)
            # Measurements are what we print, not what we check: runtime events are allowed.
            measurement = MeasurementPolicy(
                release=pinned.model_copy(update={"other_runtime_events": "allow"})
            )
        source = _collateral_source(collateral, pccs, cache_dir)
        root = _load_root(simulated_root) if simulated_root else None
    except AttestError as exc:
        fail(str(exc), EXIT_USAGE, as_json=as_json)
    log: list[Event] | None = None
    log_error: str | None = None
    if event_log is not None:
        try:
            log = load_event_log(event_log.read_bytes())
        except OSError as exc:
            fail(f"cannot read {event_log}: {exc.strerror}", EXIT_USAGE, as_json=as_json)
        except AttestError as exc:  # a forged or broken log is a finding, not a usage error
            log_error = f"event log {event_log} does not parse: {exc}"
    from umbra.attest.verify import Step, Verifier

    verdict = Verifier(measurement, source, allow_simulated, root).verify(
        raw, event_log=log, expected_report_data=expected_rd, now=at
    )
    if log_error is not None:
        verdict = verdict.with_failure(Step.EVENT_LOG, log_error)
    verdict = _with_hints(verdict)
    if as_json:
        doc = verdict.to_json()
        doc["measurements_checked"] = pinned is None
        if pinned is not None:
            doc["policy"] = _policy_doc(pinned)
        print_json(doc)
    else:
        _render(verdict, quote_file)
        if pinned is not None:
            _render_pinned(pinned)
    if not verdict.ok:
        raise typer.Exit(EXIT_FINDINGS)


def _pinned(raw: bytes, simulated: bool) -> ReleaseManifest:
    return release_from_evidence(raw, tee="simulated" if simulated else "tdx")


def _policy_doc(release: ReleaseManifest) -> dict[str, Any]:
    return release.model_dump(mode="json", exclude_defaults=True)


def _with_hints(v: Verdict) -> Verdict:
    """Say what to do about an expired collateral set, in the CLI's own terms."""
    from umbra.attest.verify import Step

    if not any(f.step is Step.COLLATERAL and "expired at" in f.reason for f in v.failures):
        return v
    failures = [
        f
        if f.step is not Step.COLLATERAL or "expired at" not in f.reason
        else type(f)(f.step, f.reason + EXPIRED_HINT)
        for f in v.failures
    ]
    return replace(v, failures=failures, reasons=[f.reason for f in failures])


def _render_pinned(release: ReleaseManifest) -> None:
    # Plain YAML, never wrapped, so it can be pasted as is.
    console.print(
        "[yellow]Measurements NOT checked (no --policy).[/] The release manifest below pins what "
        "this quote measured: review it, save it, and pass it as --policy.",
        soft_wrap=True,
    )
    typer.echo(yaml.safe_dump(_policy_doc(release), sort_keys=False), nl=False)


def _collateral_source(
    path: Path | None, pccs: list[str] | None, cache_dir: Path | None
) -> CollateralSource:
    from umbra.attest.collateral import (
        Collateral,
        CollateralCache,
        PccsCollateral,
        StaticCollateral,
    )

    if path is not None and pccs:
        raise AttestError("give --collateral or --pccs, not both")
    if path is not None:
        return StaticCollateral(Collateral.from_file(path))
    endpoints = pccs or [os.environ.get(PCCS_ENV) or INTEL_PCS_URL]
    return PccsCollateral(endpoints, cache=CollateralCache(cache_dir))


def _load_root(path: Path) -> bytes:
    from umbra.attest.simpki import cert_der

    try:
        return cert_der(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise AttestError(f"cannot load simulated root {path}: {exc}") from None


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
    if v.platform != "tdx":
        table.add_row("platform", v.platform)
    zero = "00" * 32
    for index, value in sorted(v.pcrs.items()):
        if value != zero:  # 24 PCRs, most of them zero: show what was measured
            table.add_row(f"PCR{index}", value)
    if any(value == zero for value in v.pcrs.values()):
        table.add_row("PCRs zero", ",".join(str(i) for i, x in sorted(v.pcrs.items()) if x == zero))
    table.add_row("verified at", str(v.verified_at))
    console.print(Panel(table, title=title, border_style="green" if v.ok else "red"))
    for failure in v.failures:
        console.print(
            f"[red]✗[/] {failure.step.value}: {escape(failure.reason)}",
            highlight=False,
            soft_wrap=True,
        )


def _describe(raw: bytes) -> dict[str, Any]:
    """What a user needs to pick collateral and write a policy; verifies nothing."""
    from umbra.attest.collateral import pck_identity
    from umbra.attest.verify import summarize

    quote = raw
    extra: dict[str, Any] = {"platform": "tdx"}
    if is_azure_envelope(raw):
        ev = decode_envelope(raw)
        hcl = parse_hcl_report(ev.hcl_report)
        quote = ev.td_quote
        user_data = hcl.runtime_data.user_data
        extra = {
            "platform": "azure-tdx",
            "pcrs": {str(i): v.hex() for i, v in sorted(ev.pcrs.items())},
            "runtime_user_data": user_data.hex() if user_data is not None else None,
        }
    summary = summarize(parse_quote(quote))
    fmspc, ca = pck_identity(quote)
    summary.update(
        fmspc=fmspc,
        pck_ca=ca,
        tee_tcb_svn=parse_quote(quote).td_report.tee_tcb_svn.hex(),
        **extra,
    )
    return summary


@app.command()
def parse(
    quote_file: Annotated[Path, typer.Argument(help="Quote or Azure evidence: raw, hex, base64.")],
    as_json: JsonFlag = False,
) -> None:
    """Parse QUOTE_FILE (no verification): measurements, FMSPC, TEE TCB SVN and PCK CA."""
    raw = _read_quote(quote_file, as_json)
    try:
        summary = _describe(raw)
    except AttestError as exc:
        fail(str(exc), EXIT_USAGE, as_json=as_json)
    if as_json:
        print_json(summary)
        return
    table = _table()
    for key, value in summary.items():
        if isinstance(value, dict):
            value = "\n".join(f"{k}: {v}" for k, v in value.items())
        table.add_row(key, str(value))
    console.print(Panel(table, title="quote (unverified)"))


@app.command("policy-from")
def policy_from(
    quote_file: Annotated[Path, typer.Argument(help="Quote or Azure evidence: raw, hex, base64.")],
    name: Annotated[str, typer.Option("--name", help="The release's name.")] = "pinned-release",
    simulated: Annotated[
        bool, typer.Option("--simulated", help="Write tee: simulated (for simulated quotes).")
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """Print a release manifest pinning QUOTE_FILE's measurements (unverified: run `verify`
    first, and review before trusting it)."""
    raw = _read_quote(quote_file, as_json)
    try:
        release = release_from_evidence(raw, name=name, tee="simulated" if simulated else "tdx")
    except AttestError as exc:
        fail(str(exc), EXIT_USAGE, as_json=as_json)
    if as_json:
        print_json(_policy_doc(release))
        return
    typer.echo(yaml.safe_dump(_policy_doc(release), sort_keys=False), nl=False)


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
    platform: Annotated[
        str,
        typer.Option(
            "--platform", help="tdx, or azure-tdx: evidence through a simulated paravisor + vTPM."
        ),
    ] = "tdx",
    at: Annotated[int | None, typer.Option("--at", help="Collateral issue time.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Emit a SIMULATED quote plus its collateral, event log, release manifest and root CA."""
    _at_arg(at, as_json)
    rd = _hex_arg(report_data, "--report-data", as_json) or b""
    if platform not in ("tdx", "azure-tdx"):
        fail("--platform must be tdx or azure-tdx", EXIT_USAGE, as_json=as_json)
    if platform == "azure-tdx" and event:
        fail("runtime events are not measured on azure-tdx", EXIT_USAGE, as_json=as_json)
    from umbra.attest.simazure import SimulatedAzureCvm
    from umbra.attest.simpki import SimulatedPki
    from umbra.attest.simulator import SimulatedTdx

    try:
        pki = SimulatedPki.load_or_create(pki_dir)
        files = ["quote", "collateral.json", "root.der", "release.yaml"]
        out_dir.mkdir(parents=True, exist_ok=True)
        if platform == "azure-tdx":
            if len(rd) > 64:
                raise AttestError("report_data is at most 64 bytes")
            cvm = SimulatedAzureCvm(pki, image=image)
            quote = cvm.source().get_quote(rd.ljust(64, b"\0"))
            manifest = cvm.release_manifest().model_dump(mode="json", exclude_defaults=True)
        else:
            tdx = SimulatedTdx(pki, image=image, version=version)
            names: list[dict[str, Any]] = []
            for spec in event or []:
                name, sep, payload = spec.partition("=")
                if not sep or not name:
                    raise AttestError(f"--event {spec!r}: expected NAME=HEXPAYLOAD")
                if any(n["name"] == name for n in names):
                    raise AttestError(
                        f"--event {name} given twice: a named event appears exactly once"
                    )
                value = _hex_arg(payload, f"--event {name}", as_json) or b""
                tdx.extend_runtime_event(name, value)
                names.append({"name": name, "payloads": [value.hex()]})
            quote = tdx.quote(rd)
            (out_dir / "event_log.json").write_text(dump_dstack_event_log(tdx.event_log()))
            files.insert(2, "event_log.json")
            manifest = tdx.release_manifest(events=names).model_dump(mode="json")
        issued = (int(time.time()) if at is None else at) - 60
        (out_dir / "quote").write_bytes(quote)
        (out_dir / "collateral.json").write_text(pki.collateral(issued).json_text)
        (out_dir / "root.der").write_bytes(pki.root_der)
        (out_dir / "release.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    except (AttestError, OSError) as exc:
        fail(str(exc), EXIT_USAGE, as_json=as_json)
    except ValidationError as exc:  # a release manifest the events cannot make: say which field
        fail("; ".join(str(e["msg"]) for e in exc.errors()), EXIT_USAGE, as_json=as_json)
    if as_json:
        print_json({"ok": True, "simulated": True, "files": [str(out_dir / f) for f in files]})
        return
    console.print("[bold magenta]SIMULATED[/] quote written to " + str(out_dir))
    log = f"-e {out_dir}/event_log.json " if "event_log.json" in files else ""
    console.print(
        f"verify with: umbra attest verify {out_dir}/quote -p {out_dir}/release.yaml "
        f"-c {out_dir}/collateral.json {log}"
        f"--allow-simulated --simulated-root {out_dir}/root.der",
        highlight=False,
        soft_wrap=True,
    )
