"""`umbra attest` as an operator meets it: any encoding of a quote, DCAP-only verification that
prints a policy, fresh collateral from a PCS stand-in, plain errors and step-named failures."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from umbra.attest.collateral import Collateral
from umbra.attest.simazure import SimulatedAzureCvm
from umbra.attest.simpccs import SimulatedPccs
from umbra.attest.simpki import SimulatedPki
from umbra.cli.app import app

from .conftest import DATA, T_INSIDE, T_SIM, release_for

runner = CliRunner()
COLLATERAL = str(DATA / "tdx_quote_collateral.json")


def _write(tmp_path: Path, name: str, data: bytes) -> str:
    p = tmp_path / name
    p.write_bytes(data)
    return str(p)


@pytest.mark.parametrize(
    "encode",
    [
        lambda q: q,
        lambda q: q.hex().encode(),
        lambda q: ("0x" + q.hex().upper()).encode(),
        lambda q: "\n".join(q.hex()[i : i + 64] for i in range(0, 2 * len(q), 64)).encode(),
        lambda q: base64.b64encode(q) + b"\n",
        lambda q: base64.urlsafe_b64encode(q).rstrip(b"="),
    ],
    ids=["binary", "hex", "0x-hex", "wrapped-hex", "base64", "base64url"],
)
def test_every_encoding_of_a_quote_is_recognised(
    tmp_path: Path, real_quote: bytes, encode: object
) -> None:
    path = _write(tmp_path, "q", encode(real_quote))  # type: ignore[operator]
    res = runner.invoke(app, ["attest", "parse", path, "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["fmspc"] == "B0C06F000000"


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"abc", "odd number of digits (3)"),
        (b"0x" + b"ab" * 10 + b"c", "odd number of digits"),
        (b"", "input is empty"),
        (b"\x00\x01\x02garbage", "binary input that is not a TDX quote"),
        (b"hello world!", "neither hex nor base64"),
        # Only base64's characters, padding misplaced (Hypothesis found a StopIteration here).
        (b"A===", "neither hex nor base64 (misplaced '=' padding)"),
        (b"=abcdefg", "neither hex nor base64 (misplaced '=' padding)"),
        (b"abcd", "decoded 2 bytes that are not a TDX quote"),
        (base64.b64encode(b"not a quote at all"), "not a TDX quote"),
    ],
)
def test_unrecognised_input_is_refused_in_one_line(tmp_path: Path, data: bytes, says: str) -> None:
    path = _write(tmp_path, "q", data)
    for cmd in (["parse"], ["verify", "-c", COLLATERAL], ["policy-from"]):
        res = runner.invoke(app, ["attest", cmd[0], path, *cmd[1:]])
        assert res.exit_code == 2, res.output
        assert res.exception is None or isinstance(res.exception, SystemExit)
        assert says in res.output
        assert "Traceback" not in res.output


def test_negative_at_is_refused(real_quote: bytes) -> None:
    res = runner.invoke(
        app, ["attest", "verify", str(DATA / "tdx_quote"), "-c", COLLATERAL, "--at", "-1"]
    )
    assert res.exit_code == 2
    assert "--at" in res.output


def test_parse_names_the_collateral_a_quote_needs(real_quote: bytes) -> None:
    res = runner.invoke(app, ["attest", "parse", str(DATA / "tdx_quote")])
    assert res.exit_code == 0
    for text in ("fmspc", "B0C06F000000", "pck_ca", "platform", "tee_tcb_svn", "0601030000"):
        assert text in res.stdout


def test_dcap_only_verify_prints_a_policy_that_then_verifies(tmp_path: Path) -> None:
    base = ["attest", "verify", str(DATA / "tdx_quote"), "-c", COLLATERAL, "--at", str(T_INSIDE)]
    res = runner.invoke(app, [*base, "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["verdict"] == "PASS"
    assert doc["measurements_checked"] is False
    assert doc["tcb_status"] == "UpToDate"
    policy = tmp_path / "release.yaml"
    human = runner.invoke(app, base)
    assert "Measurements NOT checked" in human.stdout
    policy.write_text(human.stdout[human.stdout.index("apiVersion:") :])
    assert yaml.safe_load(policy.read_text()) == doc["policy"]
    again = runner.invoke(app, [*base, "-p", str(policy), "--json"])
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["measurements_checked"] is True
    from_cmd = runner.invoke(app, ["attest", "policy-from", str(DATA / "tdx_quote")])
    assert yaml.safe_load(from_cmd.stdout) == doc["policy"]


def test_dcap_only_still_fails_on_tcb(outdated_quote: bytes, tmp_path: Path) -> None:
    collateral = Collateral.from_file(DATA / "tdx_quote_outdated_collateral.json")
    res = runner.invoke(
        app,
        [
            "attest",
            "verify",
            str(DATA / "tdx_quote_outdated"),
            "-c",
            str(DATA / "tdx_quote_outdated_collateral.json"),
            "--at",
            str(collateral.issue_date + 3600),
            "--json",
        ],
    )
    assert res.exit_code == 1
    doc = json.loads(res.stdout)
    assert doc["failed_steps"] == ["tcb"]
    assert "No matching TCB level" in doc["failures"][0]["reason"]


def test_fresh_collateral_by_default_from_a_pcs_stand_in(
    tmp_path: Path, real_collateral: Collateral, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No --collateral, no --pccs: the default PCS (here a loopback stand-in serving the recorded
    collateral, named by UMBRA_PCCS_URL) is asked, and the answer cached."""
    with SimulatedPccs(None, collateral=real_collateral) as pcs:
        monkeypatch.setenv("UMBRA_PCCS_URL", pcs.url)
        args = ["attest", "verify", str(DATA / "tdx_quote"), "--at", str(T_INSIDE), "--json"]
        res = runner.invoke(app, [*args, "--cache-dir", str(tmp_path / "cache")])
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["tcb_status"] == "UpToDate"
        assert any("/tdx/certification/v4/tcb?fmspc=B0C06F000000" in r for r in pcs.requests)
    assert any((tmp_path / "cache").iterdir())
    monkeypatch.setenv("UMBRA_PCCS_URL", "http://127.0.0.1:9")  # discard port: nobody answers
    down = runner.invoke(app, ["attest", "verify", str(DATA / "tdx_quote"), "--json"])
    assert down.exit_code == 1
    assert json.loads(down.stdout)["failed_steps"] == ["collateral"]


def test_forged_event_log_is_a_failed_verdict(tmp_path: Path, dstack_report: dict) -> None:  # type: ignore[type-arg]
    quote = _write(tmp_path, "q.hex", dstack_report["quote"].encode())
    events = json.loads(dstack_report["event_log"])
    runtime = next(e for e in events if e["imr"] == 3 and e["event_payload"])
    runtime["event_payload"] = "00" + runtime["event_payload"][2:]  # the logged digest now lies
    log = _write(tmp_path, "log.json", json.dumps(events).encode())
    pki = SimulatedPki.generate()  # any collateral: the log's failure must be reported anyway
    coll = _write(tmp_path, "c.json", pki.collateral(T_SIM).json_text.encode())
    res = runner.invoke(app, ["attest", "verify", quote, "-c", coll, "-e", log, "--json"])
    assert res.exit_code == 1, res.output
    doc = json.loads(res.stdout)
    assert "event_log" in doc["failed_steps"]
    assert any("logged digest does not match" in f["reason"] for f in doc["failures"])


def test_azure_evidence_through_the_cli(tmp_path: Path) -> None:
    pki = SimulatedPki.generate()
    cvm = SimulatedAzureCvm(pki)
    evidence = _write(tmp_path, "ev.b64", base64.b64encode(cvm.source().get_quote(bytes(64))))
    root = _write(tmp_path, "root.der", pki.root_der)
    coll = _write(tmp_path, "c.json", pki.collateral(T_SIM - 3600).json_text.encode())
    parsed = runner.invoke(app, ["attest", "parse", evidence, "--json"])
    assert parsed.exit_code == 0, parsed.output
    assert json.loads(parsed.stdout)["platform"] == "azure-tdx"
    policy = tmp_path / "release.yaml"
    made = runner.invoke(app, ["attest", "policy-from", evidence, "--simulated"])
    policy.write_text(made.stdout)
    assert yaml.safe_load(made.stdout)["platform"] == "azure-tdx"
    args = ["attest", "verify", evidence, "-c", coll, "--at", str(T_SIM), "-p", str(policy)]
    sim = ["--allow-simulated", "--simulated-root", root, "--json"]
    res = runner.invoke(app, [*args, *sim, "--report-data", "00" * 64])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["pcrs"]["0"] == cvm.pcrs[0].hex()
    stale = runner.invoke(app, [*args, *sim, "--report-data", "11" * 64])
    assert stale.exit_code == 1
    assert json.loads(stale.stdout)["failed_steps"] == ["binding"]


def test_simulate_azure_then_verify(tmp_path: Path) -> None:
    out = tmp_path / "az"
    made = runner.invoke(
        app,
        ["attest", "simulate", str(out), "--pki", str(tmp_path / "pki"), "--platform", "azure-tdx",
         "--at", str(T_SIM), "--report-data", "ab" * 64],
    )  # fmt: skip
    assert made.exit_code == 0, made.output
    assert not (out / "event_log.json").exists()
    args = ["attest", "verify", str(out / "quote"), "-p", str(out / "release.yaml"),
            "-c", str(out / "collateral.json"), "--at", str(T_SIM), "--allow-simulated",
            "--simulated-root", str(out / "root.der")]  # fmt: skip
    res = runner.invoke(app, [*args, "--report-data", "ab" * 64])
    assert res.exit_code == 0, res.output
    assert "PASS" in res.stdout and "PCR0" in res.stdout and "SIMULATED TEE" in res.stdout
    refused = runner.invoke(
        app, ["attest", "simulate", str(out), "--platform", "azure-tdx", "--event", "a=00"]
    )
    assert refused.exit_code == 2


# --- issue 24: the rough edges -------------------------------------------------------------


def test_a_quote_that_does_not_parse_is_exit_2_everywhere(
    tmp_path: Path, real_quote: bytes
) -> None:
    """ "This is not a quote" had three exit codes: 1 from verify -p, 2 without, 1 from parse."""
    path = _write(tmp_path, "q", real_quote[:700])
    policy = _write(tmp_path, "p.json", json.dumps(release_for(real_quote).model_dump()).encode())
    for cmd in (
        ["parse"],
        ["policy-from"],
        ["verify", "-c", COLLATERAL, "--at", str(T_INSIDE)],
        ["verify", "-c", COLLATERAL, "--at", str(T_INSIDE), "-p", policy],
    ):
        res = runner.invoke(app, ["attest", cmd[0], path, *cmd[1:], "--json"])
        assert res.exit_code == 2, (cmd, res.output)
        doc = json.loads(res.stdout)
        assert doc["ok"] is False and "signature_data.size" in doc["error"], doc


def test_negative_at_under_json_is_one_json_line() -> None:
    for cmd in (["verify", str(DATA / "tdx_quote"), "-c", COLLATERAL], ["simulate", "out"]):
        res = runner.invoke(app, ["attest", *cmd, "--at", "-1", "--json"])
        assert res.exit_code == 2, res.output
        assert json.loads(res.stdout) == {
            "ok": False,
            "error": "--at must be a Unix time (seconds, >= 0), not -1",
        }


def _simulated(tmp_path: Path, *extra: str) -> tuple[Path, list[str]]:
    out = tmp_path / "sim"
    made = runner.invoke(
        app,
        ["attest", "simulate", str(out), "--pki", str(tmp_path / "pki"), "--at", str(T_SIM),
         *extra],
    )  # fmt: skip
    assert made.exit_code == 0, made.output
    sim = ["-c", str(out / "collateral.json"), "--at", str(T_SIM), "--allow-simulated",
           "--simulated-root", str(out / "root.der")]  # fmt: skip
    return out, sim


def test_report_data_takes_0x_like_quotes_do(tmp_path: Path) -> None:
    out, sim = _simulated(tmp_path, "--report-data", "0x" + "AB" * 64)
    quote = str(out / "quote")
    for rd in ("0x" + "ab" * 64, "0X" + "AB" * 64, "ab" * 64):
        res = runner.invoke(app, ["attest", "verify", quote, *sim, "--report-data", rd, "--json"])
        assert res.exit_code == 0, (rd, res.output)
    res = runner.invoke(app, ["attest", "verify", quote, *sim, "--report-data", "0x" + "cd" * 64])
    assert res.exit_code == 1


def test_simulate_refuses_an_event_named_twice(tmp_path: Path) -> None:
    res = runner.invoke(
        app,
        ["attest", "simulate", str(tmp_path / "o"), "--pki", str(tmp_path / "pki"),
         "--event", "compose-hash=aa", "--event", "compose-hash=bb"],
    )  # fmt: skip
    assert res.exit_code == 2, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)
    assert "--event compose-hash given twice" in res.output


def test_the_printed_policy_verifies_a_quote_with_runtime_events_and_no_log(
    tmp_path: Path,
) -> None:
    """RTMR3 != 0 and no log: the policy policy-from (or verify without -p) printed refused the
    very quote it was made from ("RTMR3 holds runtime events but no event log ...")."""
    out, sim = _simulated(tmp_path, "--event", "compose-hash=aa")
    quote = str(out / "quote")
    made = runner.invoke(app, ["attest", "policy-from", quote, "--simulated"])
    assert made.exit_code == 0, made.output
    assert yaml.safe_load(made.stdout)["other_runtime_events"] == "allow"
    policy = _write(tmp_path, "release.yaml", made.stdout.encode())
    res = runner.invoke(app, ["attest", "verify", quote, *sim, "-p", policy, "--json"])
    assert res.exit_code == 0, res.output
    printed = runner.invoke(app, ["attest", "verify", quote, *sim, "--json"])
    assert printed.exit_code == 0, printed.output
    policy = _write(tmp_path, "r2.json", json.dumps(json.loads(printed.stdout)["policy"]).encode())
    res = runner.invoke(app, ["attest", "verify", quote, *sim, "-p", policy, "--json"])
    assert res.exit_code == 0, res.output
