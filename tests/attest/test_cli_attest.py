"""`umbra attest` end to end through typer: verdicts, reasons, exit codes, JSON."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from typer.testing import CliRunner

from umbra.attest.simpccs import SimulatedPccs
from umbra.attest.simpki import SimulatedPki
from umbra.cli.app import app

from .conftest import DATA, T_INSIDE, T_SIM, release_for

runner = CliRunner()


def _release_file(tmp_path: Path, quote: bytes, **extra: object) -> Path:
    p = tmp_path / "release.yaml"
    p.write_text(yaml.safe_dump(release_for(quote, **extra).model_dump(mode="json")))
    return p


def test_verify_real_quote_passes_and_fails_with_reasons(tmp_path: Path, real_quote: bytes) -> None:
    rel = _release_file(tmp_path, real_quote)
    args = [
        "attest",
        "verify",
        str(DATA / "tdx_quote"),
        "-p",
        str(rel),
        "-c",
        str(DATA / "tdx_quote_collateral.json"),
    ]
    ok = runner.invoke(app, [*args, "--at", str(T_INSIDE), "--json"])
    assert ok.exit_code == 0, ok.output
    doc = json.loads(ok.stdout)
    assert doc["verdict"] == "PASS"
    assert doc["tcb_status"] == "UpToDate"
    assert doc["simulated"] is False
    late = runner.invoke(app, [*args, "--at", str(T_INSIDE + 10)])
    assert late.exit_code == 1
    assert "FAIL" in late.stdout
    assert (
        "collateral: collateral expired at 2025-07-19T10:00:35Z "
        "(use fresh collateral, or --at for old vectors)" in late.stdout
    )


def test_verify_hex_quote_and_bad_rtmr(tmp_path: Path, real_quote: bytes) -> None:
    hex_file = tmp_path / "quote.hex"
    hex_file.write_text(real_quote.hex() + "\n")
    rel = _release_file(tmp_path, real_quote, rtmr2=["00" * 48])
    res = runner.invoke(
        app,
        [
            "attest",
            "verify",
            str(hex_file),
            "-p",
            str(rel),
            "-c",
            str(DATA / "tdx_quote_collateral.json"),
            "--at",
            str(T_INSIDE),
            "--json",
        ],
    )
    assert res.exit_code == 1
    reasons = json.loads(res.stdout)["reasons"]
    assert len(reasons) == 1
    assert reasons[0].startswith("RTMR2 ")


def test_usage_errors_exit_2(tmp_path: Path, real_quote: bytes) -> None:
    rel = _release_file(tmp_path, real_quote)
    missing = runner.invoke(app, ["attest", "verify", str(tmp_path / "nope"), "-p", str(rel)])
    assert missing.exit_code == 2
    bad_policy = tmp_path / "bad.yaml"
    bad_policy.write_text("apiVersion: umbra/v1\nkind: ReleaseManifest\nsurprise: 1\n")
    res = runner.invoke(
        app,
        [
            "attest",
            "verify",
            str(DATA / "tdx_quote"),
            "-p",
            str(bad_policy),
            "-c",
            str(DATA / "tdx_quote_collateral.json"),
        ],
    )
    assert res.exit_code == 2
    assert "surprise" in res.output


def test_simulate_then_verify(tmp_path: Path) -> None:
    out = tmp_path / "sim"
    res = runner.invoke(
        app,
        [
            "attest",
            "simulate",
            str(out),
            "--pki",
            str(tmp_path / "pki"),
            "--event",
            "compose-hash=" + "ab" * 32,
            "--at",
            str(T_SIM),
            "--report-data",
            "11" * 64,
            "--version",
            "5",
        ],
    )
    assert res.exit_code == 0, res.output
    args = [
        "attest",
        "verify",
        str(out / "quote"),
        "-p",
        str(out / "release.yaml"),
        "-c",
        str(out / "collateral.json"),
        "-e",
        str(out / "event_log.json"),
        "--at",
        str(T_SIM),
        "--report-data",
        "11" * 64,
    ]
    refused = runner.invoke(app, [*args, "--json"])
    assert refused.exit_code == 1
    assert "not allowed by the caller" in json.loads(refused.stdout)["reasons"][0]
    accepted = runner.invoke(
        app, [*args, "--allow-simulated", "--simulated-root", str(out / "root.der")]
    )
    assert accepted.exit_code == 0, accepted.output
    assert "SIMULATED TEE" in accepted.stdout
    assert "PASS" in accepted.stdout
    assert "compose-hash" in accepted.stdout


def test_parse(real_quote: bytes) -> None:
    res = runner.invoke(app, ["attest", "parse", str(DATA / "tdx_quote_outdated"), "--json"])
    assert res.exit_code == 0
    assert json.loads(res.stdout)["td_report"] == "1.5"


def test_verify_fetches_from_pccs(tmp_path: Path) -> None:
    pki = SimulatedPki.load_or_create(tmp_path / "pki")
    out = tmp_path / "sim"
    made = runner.invoke(
        app, ["attest", "simulate", str(out), "--pki", str(tmp_path / "pki"), "--at", str(T_SIM)]
    )
    assert made.exit_code == 0, made.output
    with SimulatedPccs(pki, T_SIM - 3600) as pccs:
        res = runner.invoke(
            app,
            [
                "attest",
                "verify",
                str(out / "quote"),
                "-p",
                str(out / "release.yaml"),
                "--pccs",
                pccs.url,
                "--cache-dir",
                str(tmp_path / "cache"),
                "--at",
                str(T_SIM),
                "--allow-simulated",
                "--simulated-root",
                str(out / "root.der"),
                "--json",
            ],
        )
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["simulated"] is True
        assert pccs.requests
    assert any((tmp_path / "cache").iterdir())


def test_simulate_usage_errors(tmp_path: Path) -> None:
    base = ["attest", "simulate", str(tmp_path / "o"), "--pki", str(tmp_path / "pki")]
    bad_version = runner.invoke(app, [*base, "--version", "7"])
    assert bad_version.exit_code == 2
    assert "version must be 4 or 5" in bad_version.output
    bad_event = runner.invoke(app, [*base, "--event", "no-equals-sign"])
    assert bad_event.exit_code == 2
    assert "NAME=HEXPAYLOAD" in bad_event.output
