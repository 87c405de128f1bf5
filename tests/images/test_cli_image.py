"""`umbra image` and `umbra sandbox`/`umbra forwarder` through the real typer app."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import yaml
from typer.testing import CliRunner

from umbra.attest.measurement import load_measurement_policy, load_release_manifest
from umbra.cli.app import app
from umbra.images.definition import load_definition
from umbra.images.measure import measure

DEFS = Path(__file__).resolve().parents[2] / "images" / "definitions"
ALICE = (
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl alice@laptop"
)
runner = CliRunner()


def test_shipped_security_release_matches_its_definition() -> None:
    # The Dev CVM example pins this file; it must be what measuring the definition gives.
    m = measure(load_definition(DEFS / "security-cvm.example.yaml"))
    assert load_release_manifest(DEFS / "security-cvm.example.release.yaml") == m.release


def test_measure_prints_golden_values_recomputable_from_the_written_files(tmp_path: Path) -> None:
    result = runner.invoke(
        app,
        ["image", "measure", str(DEFS / "dev-cvm.example.yaml"), "--out", str(tmp_path),
         "--cvm-id", "dev-alice-1", "--ssh-key", ALICE, "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    compose = (tmp_path / "dev-cvm.json").read_text()
    app_compose = (tmp_path / "app-compose.json").read_bytes()
    assert json.loads(app_compose)["dev_cvm_host"] == compose
    assert out["compose_sha256"] == hashlib.sha256(compose.encode()).hexdigest()
    assert out["compose_hash"] == hashlib.sha256(app_compose).hexdigest()
    events = {e["name"]: e for e in out["instance"]["events"]}
    keys_digest = hashlib.sha256(" ".join(ALICE.split()[:2]).encode()).hexdigest()
    assert events["umbra.ssh-authorized-keys"]["payload"] == keys_digest
    assert events["umbra.cvm-id"]["payload"] == b"dev-alice-1".hex()
    # The written release + binding load as a verifier's measurement policy.
    policy = load_measurement_policy(tmp_path / "release.yaml", tmp_path / "binding.yaml")
    names = [e.name for e in policy.expected_events()]
    # The per-boot events are named (present once, any payload); their values come from the log.
    assert names == [
        "compose-hash",
        "umbra.cvm-id",
        "umbra.boot-id",
        "umbra.ssh-host-key",
        "umbra.ssh-authorized-keys",
    ]
    assert out["instance"]["expected_rtmr3"] is None
    assert out["instance"]["per_boot_events"] == ["umbra.boot-id", "umbra.ssh-host-key"]


def test_sign_and_verify_manifest(tmp_path: Path) -> None:
    key = tmp_path / "release.key"
    assert runner.invoke(app, ["image", "keygen", str(key)]).exit_code == 0
    assert oct(key.stat().st_mode & 0o777) == "0o600"
    out = tmp_path / "out"
    result = runner.invoke(
        app,
        ["image", "measure", str(DEFS / "security-cvm.example.yaml"), "-o", str(out), "--sign-key", str(key)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    signed = out / "measurement-manifest.signed.json"
    ok = runner.invoke(app, ["image", "verify-manifest", str(signed), "-k", f"{key}.pub"])
    assert ok.exit_code == 0 and "OK" in ok.stdout
    doc = json.loads(signed.read_text())
    doc["manifest"]["release"]["mrtd"] = ["00" * 48]
    signed.write_text(json.dumps(doc))
    bad = runner.invoke(app, ["image", "verify-manifest", str(signed), "-k", f"{key}.pub"])
    assert bad.exit_code == 1 and "altered" in bad.output


def test_measure_refuses_bad_definitions(tmp_path: Path) -> None:
    doc = yaml.safe_load((DEFS / "security-cvm.example.yaml").read_text())
    doc["compose"]["images"]["proxy"] = "ghcr.io/umbra/proxy:latest"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    result = runner.invoke(app, ["image", "measure", str(bad)])
    assert result.exit_code == 2
    assert "compose.images.proxy" in result.output and "not pinned by digest" in result.output
    keyless = runner.invoke(
        app, ["image", "measure", str(DEFS / "dev-cvm.example.yaml"), "--cvm-id", "x"]
    )
    assert keyless.exit_code == 2 and "at least one SSH authorized key" in keyless.output


def test_sandbox_render_and_check(tmp_path: Path) -> None:
    out = tmp_path / "compose.yaml"
    r = runner.invoke(
        app, ["sandbox", "render", str(DEFS / "security-cvm.example.yaml"), "-o", str(out)]
    )
    assert r.exit_code == 0, r.output
    check = ["sandbox", "check", "--role", "security-cvm", str(out)]
    assert runner.invoke(app, check).exit_code == 0
    out.write_text(out.read_text().replace("    restart: ", "    privileged: true\n    restart: "))
    r = runner.invoke(app, check)
    assert r.exit_code == 1 and "privileged containers are never allowed" in r.output


def test_forwarder_refuses_to_start_without_its_identity(tmp_path: Path) -> None:
    host = json.loads(
        runner.invoke(app, ["sandbox", "render", str(DEFS / "dev-cvm.example.yaml")]).stdout
    )
    cfg = host["forwarder"]
    cfg["cvm_id_file"] = str(tmp_path / "missing")
    (tmp_path / "f.json").write_text(json.dumps(cfg))
    r = runner.invoke(app, ["forwarder", "serve", "--config", str(tmp_path / "f.json")])
    assert r.exit_code == 2 and "cannot read the CVM id" in r.output
    (tmp_path / "missing").write_text("bad id with spaces\n")
    r = runner.invoke(app, ["forwarder", "serve", "--config", str(tmp_path / "f.json")])
    assert r.exit_code == 2 and "does not match" in r.output


BOB = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHp3bO0b7kl6pVF5rSqMXh2XSE8C3cJ2kQ5vZ5m7y2Xb bob"


def test_the_cli_checks_launch_bound_ssh_keys_end_to_end(tmp_path: Path) -> None:
    """measure (golden values + binding) → a simulated TD launches them → attest verify."""
    golden = tmp_path / "golden"
    r = runner.invoke(
        app,
        ["image", "measure", str(DEFS / "dev-cvm.example.yaml"), "-o", str(golden),
         "--cvm-id", "dev-alice-1", "--ssh-key", ALICE, "--json",
         "--boot-id", "ab" * 16, "--ssh-host-key", BOB],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["instance"]["events"][-1]["name"] == "umbra.ssh-host-key"
    td = tmp_path / "td"
    events = [f"compose-hash={out['compose_hash']}"] + [
        f"{e['name']}={e['payload']}" for e in out["instance"]["events"]
    ]
    args = [
        "attest",
        "simulate",
        str(td),
        "--pki",
        str(tmp_path / "pki"),
        "--image",
        "umbra-dev-cvm",
    ]
    r = runner.invoke(app, args + [x for e in events for x in ("--event", e)])
    assert r.exit_code == 0, r.output

    def verify(binding: Path) -> tuple[int, str]:
        res = runner.invoke(
            app,
            ["attest", "verify", str(td / "quote"), "-p", str(golden / "release.yaml"), "-b", str(binding),
             "-c", str(td / "collateral.json"), "-e", str(td / "event_log.json"),
             "--allow-simulated", "--simulated-root", str(td / "root.der"), "--json"],
        )  # fmt: skip
        return res.exit_code, res.stdout

    code, text = verify(golden / "binding.yaml")
    assert code == 0, text
    other = tmp_path / "other"
    r = runner.invoke(
        app,
        ["image", "measure", str(DEFS / "dev-cvm.example.yaml"), "-o", str(other),
         "--cvm-id", "dev-alice-1", "--ssh-key", BOB],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    code, text = verify(other / "binding.yaml")
    assert code == 1 and "umbra.ssh-authorized-keys" in text


def test_the_manifest_names_the_boot_payload_from_image_disks(tmp_path: Path) -> None:
    # The shape `umbra image disks --json` prints (paths included; the manifest drops them).
    disks = {
        "raw": "/build/disk.raw",
        "raw_sha256": "a" * 64,
        "gcp": "/build/umbra-gcp.tar.gz",
        "azure": "/build/umbra-azure.vhd",
        "uki": "/build/umbra-uki.efi",
        "uki_sha256": "b" * 64,
        "uki_authenticode_sha384": "c" * 96,
        "uki_authenticode_sha256": "d" * 64,
        "cmdline": f"root=/dev/mapper/umbra-root ro umbra.verity={'e' * 64} console=ttyS0",
        "verity_root_hash": "e" * 64,
    }
    boot = tmp_path / "disks.json"
    boot.write_text(json.dumps(disks))
    args = ["image", "measure", str(DEFS / "dev-cvm.example.yaml"), "--boot", str(boot)]
    r = runner.invoke(app, [*args, "--out", str(tmp_path / "o"), "--json"])
    assert r.exit_code == 0, r.output
    manifest = json.loads((tmp_path / "o" / "measurement-manifest.json").read_text())
    assert manifest["boot"] == {
        k: v for k, v in disks.items() if k not in ("raw", "gcp", "azure", "uki")
    }
    assert json.loads(r.stdout)["boot"]["uki_authenticode_sha384"] == "c" * 96
    # A missing or malformed digest is refused, naming the file and the field.
    for broken in ({**disks, "uki_authenticode_sha384": "c" * 64}, {"raw_sha256": "a" * 64}):
        boot.write_text(json.dumps(broken))
        r = runner.invoke(app, args)
        assert r.exit_code == 2, r.output
        assert str(boot) in r.output and "uki_" in r.output
    boot.write_text("{not json")
    r = runner.invoke(app, args)
    assert r.exit_code == 2 and "line 1" in r.output
