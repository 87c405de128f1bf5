"""`umbra image`: measure a CVM release (golden values), sign and check measurement manifests.

Why one module: it is the one `umbra image` Typer group; each command is an adapter over
umbra.images (measure, manifests, build, launch agent, OS image, disks) and most of its length is
option declarations."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
import yaml
from pydantic import ValidationError
from rich.table import Table

from umbra.attest.measurement import canonical_ssh_key
from umbra.cli.output import EXIT_USAGE, console, fail, print_json
from umbra.contracts.validation import first_problem
from umbra.images.definition import DefinitionError, load_definition
from umbra.images.image_store import IMAGES_DIR
from umbra.images.lock_policy import LockPolicy
from umbra.sandbox.validate import ComposeError

if TYPE_CHECKING:  # measuring and signing load attestation and templates: not for --help
    from collections.abc import Callable, Sequence

    from umbra.attest.eventlog import Event
    from umbra.images.definition import ImageDefinition
    from umbra.images.manifest import BootEntry
    from umbra.images.td_boot import TdBootGolden, TpmBootGolden

app = typer.Typer(
    help="Measure CVM releases: compose hash, RTMR3 events, signed manifests.",
    no_args_is_help=True,
)

JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")]
LockPolicyOption = Annotated[
    LockPolicy,
    typer.Option(
        "--lock-policy",
        help="strict (releases): exactly the lock's versions. security-updates (the test "
        "suite): also a newer version from the suite's -security/-updates/point release, "
        "reported on stderr and recorded.",
    ),
]


def _ssh_keys(keys: list[str], keys_file: Path | None, as_json: bool) -> list[str]:
    out = list(keys)
    if keys_file is not None:
        try:
            lines = keys_file.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            fail(f"cannot read {keys_file}: {exc}", EXIT_USAGE, as_json=as_json)
        out += [ln for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    for key in out:
        try:
            canonical_ssh_key(key)
        except ValueError as exc:
            fail(str(exc), EXIT_USAGE, as_json=as_json)
    return out


def _write(path: Path, data: str, mode: int = 0o644) -> None:
    path.write_text(data)
    os.chmod(path, mode)


def _boot_entry(path: Path) -> BootEntry:
    from umbra.images.manifest import boot_entry

    try:
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict):
            raise DefinitionError(f"{path}: not a JSON object (umbra image disks --json)")
        return boot_entry(doc)
    except json.JSONDecodeError as exc:
        raise DefinitionError(f"{path}: line {exc.lineno}: {exc.msg}") from None
    except ValidationError as exc:
        raise DefinitionError(f"{path}: {first_problem(exc)}") from None


def _tdx_release(
    definition: ImageDefinition, boot: Path | None, cloud: str | None, firmware: Path | None
) -> tuple[ImageDefinition, TdBootGolden | TpmBootGolden]:
    """The definition as a tee: tdx release for `cloud` (images.td_release)."""
    from umbra.images.td_release import (
        Cloud,
        TdReleaseError,
        golden_from_disks,
        load_firmware,
        tdx_definition,
    )

    if cloud is None or firmware is None or boot is None:
        raise TdReleaseError(
            "--cloud, --firmware and --boot come together: a tee: tdx release takes MRTD/RTMR0 "
            "from the cloud's firmware inputs and computes RTMR1/RTMR2 from the built disks"
        )
    try:
        which = Cloud(cloud)
    except ValueError:
        raise TdReleaseError(f"--cloud: {cloud!r} is not one of gcp, azure") from None
    inputs = load_firmware(firmware)
    try:
        disks = json.loads(boot.read_text())
    except json.JSONDecodeError as exc:
        raise TdReleaseError(f"{boot}: line {exc.lineno}: {exc.msg}") from None
    if not isinstance(disks, dict):
        raise TdReleaseError(f"{boot}: not a JSON object (umbra image disks --json)")
    golden = golden_from_disks(disks, str(boot), which)
    return tdx_definition(definition, which, inputs, golden, str(firmware)), golden


@app.command("measure")
def measure_cmd(
    definition: Annotated[Path, typer.Argument(help="Image definition (YAML).")],
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Write rendered files and manifests here.")
    ] = None,
    sign_key: Annotated[
        Path | None, typer.Option("--sign-key", help="Ed25519 private key (PEM) to sign with.")
    ] = None,
    cvm_id: Annotated[
        str | None, typer.Option("--cvm-id", help="Also show one instance's launch events.")
    ] = None,
    ssh_key: Annotated[
        list[str] | None, typer.Option("--ssh-key", help="An authorized key line (repeatable).")
    ] = None,
    ssh_keys_file: Annotated[
        Path | None, typer.Option("--ssh-keys-file", help="authorized_keys file.")
    ] = None,
    provenance: Annotated[
        list[Path] | None,
        typer.Option("--provenance", help="DSSE provenance of the images (named in the manifest)."),
    ] = None,
    host_firewall: Annotated[
        Path | None,
        typer.Option("--host-firewall", help="The instance's umbra-host-firewall ruleset (Dev)."),
    ] = None,
    boot_id: Annotated[
        str | None,
        typer.Option("--boot-id", help="Dev: the boot's umbra.boot-id (hex), read from its log."),
    ] = None,
    ssh_host_key: Annotated[
        str | None,
        typer.Option("--ssh-host-key", help="Dev: the boot's umbra.ssh-host-key, from its log."),
    ] = None,
    boot: Annotated[
        Path | None,
        typer.Option("--boot", help="`umbra image disks --json` output: the UKI's digests."),
    ] = None,
    cloud: Annotated[
        str | None,
        typer.Option(
            "--cloud",
            help="Write a tee: tdx release for this cloud from --boot's UKI and disk and "
            "--firmware's inputs: gcp: RTMR1/RTMR2 computed, MRTD/RTMR0 inputs; azure "
            "(platform azure-tdx): PCRs 4, 5, 9, 11, 12 computed, MRTD and PCRs 0-3, 6, 7 inputs.",
        ),
    ] = None,
    firmware: Annotated[
        Path | None,
        typer.Option("--firmware", help="Per-cloud TD firmware inputs (kind: TdFirmware)."),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Render the release's compose file and print its golden values."""
    from umbra.images.manifest import build_manifest
    from umbra.images.measure import (
        BOOT_EVENTS,
        boot_events,
        expected_rtmr3,
        instance_events,
        measure,
    )
    from umbra.images.provenance import ProvenanceError, provenance_index
    from umbra.images.signing import SignatureError, load_private_key, sign_manifest
    from umbra.images.td_boot import TpmBootGolden
    from umbra.images.td_release import TdReleaseError

    keys = _ssh_keys(ssh_key or [], ssh_keys_file, as_json)
    golden = None
    try:
        loaded = load_definition(definition)
        if cloud is not None or firmware is not None:
            loaded, golden = _tdx_release(loaded, boot, cloud, firmware)
        m = measure(loaded)
        index = provenance_index([p.read_bytes() for p in provenance]) if provenance else None
        ruleset = host_firewall.read_text() if host_firewall is not None else None
        boot_doc = _boot_entry(boot) if boot is not None else None
    except (DefinitionError, ComposeError, ProvenanceError, TdReleaseError) as exc:
        fail(str(exc), EXIT_USAGE, as_json=as_json)
    except OSError as exc:
        fail(f"cannot read {exc.filename}: {exc.strerror}", EXIT_USAGE, as_json=as_json)
    manifest = build_manifest(m, index, boot_doc)
    result: dict[str, Any] = {
        "release": m.release.name,
        "role": m.role,
        "tee": m.release.tee,
        "compose_sha256": m.compose.sha256,
        "compose_hash": m.compose_hash.hex(),
        "mrtd": m.release.mrtd,
        "rtmr0": m.release.rtmr0,
        "rtmr1": m.release.rtmr1,
        "rtmr2": m.release.rtmr2,
        "rtmr3_events": [e.model_dump(exclude_none=True) for e in manifest.rtmr3_events],
    }
    if boot_doc is not None:
        result["boot"] = boot_doc.model_dump()
    if golden is not None:
        result["cloud"] = cloud
        # A TD's registers are SHA-384 (RTMR1/2); Azure's vTPM PCRs are SHA-256.
        on_tpm = isinstance(golden, TpmBootGolden)
        result["td_boot_events"] = [
            {"rtmr": None if on_tpm else e.rtmr, "pcr": e.pcr, "event_type": f"{e.event_type:#x}",
             "event": e.label, "digest": (e.sha256 if on_tpm else e.sha384).hex()}
            for e in golden.measured
        ]  # fmt: skip
        if on_tpm:
            result["pcrs"] = m.release.pcrs
    binding = None
    instance_args = (keys, ruleset, boot_id, ssh_host_key)
    if cvm_id is not None or any(a is not None and a != [] for a in instance_args):
        if cvm_id is None:
            fail(
                "--ssh-key/--host-firewall/--boot-id/--ssh-host-key need --cvm-id (the instance "
                "they are bound to)",
                EXIT_USAGE,
                as_json=as_json,
            )
        per_boot = m.role == "dev-cvm" and (boot_id is None or ssh_host_key is None)
        try:
            launch = instance_events(m.role, cvm_id, keys, ruleset)
            binding = m.binding(cvm_id, keys, ruleset)
            if boot_id is not None or ssh_host_key is not None:
                if boot_id is None or ssh_host_key is None:
                    raise ValueError("--boot-id and --ssh-host-key come together")
                launch += boot_events(m.role, boot_id, ssh_host_key)
        except ValueError as exc:
            fail(str(exc), EXIT_USAGE, as_json=as_json)
        rtmr3 = expected_rtmr3(m.events() + launch).hex()
        result["instance"] = {
            "cvm_id": cvm_id,
            "events": [
                {"name": e.name, "payload": e.payload.hex(), "digest": e.digest.hex()}
                for e in launch
            ],
            # A Dev CVM's RTMR3 ends with per-boot events no one can predict: without their
            # values (--boot-id/--ssh-host-key, read from the boot's log) this is the value
            # before them, and per_boot_events says what must follow.
            "expected_rtmr3": None if per_boot else rtmr3,
            "rtmr3_before_boot": rtmr3 if per_boot else None,
            "per_boot_events": list(BOOT_EVENTS) if per_boot else [],
        }
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        _write(out / m.compose.name, m.compose.text)
        _write(out / "app-compose.json", m.app_compose.decode())
        release_doc = m.release.model_dump(mode="json", exclude_none=True)
        _write(out / "release.yaml", yaml.safe_dump(release_doc, sort_keys=False))
        _write(out / "measurement-manifest.json", manifest.canonical().decode() + "\n")
        if golden is not None:  # what RTMR1/RTMR2 were replayed from, for a reviewer
            events = json.dumps(result["td_boot_events"], indent=1)
            _write(out / "td-boot-events.json", events + "\n")
        if binding is not None:
            doc = binding.model_dump(mode="json", exclude_none=True)
            _write(out / "binding.yaml", yaml.safe_dump(doc, sort_keys=False))
        if sign_key is not None:
            try:
                signed = sign_manifest(manifest, load_private_key(sign_key))
            except SignatureError as exc:
                fail(str(exc), EXIT_USAGE, as_json=as_json)
            _write(out / "measurement-manifest.signed.json", signed)
        result["written_to"] = str(out)
    elif sign_key is not None:
        fail("--sign-key needs --out", EXIT_USAGE, as_json=as_json)
    if as_json:
        print_json(result)
        return
    _show(result)


def _show(r: dict[str, Any]) -> None:
    t = Table(title=f"{r['release']} ({r['role']}, tee: {r['tee']})", show_lines=False)
    t.add_column("value")
    t.add_column("golden", overflow="fold")
    t.add_row("measured document sha256", r["compose_sha256"])
    t.add_row("compose-hash (sha256 app-compose.json)", r["compose_hash"])
    for reg in ("mrtd", "rtmr0", "rtmr1", "rtmr2"):
        if r[reg] is not None:  # azure-tdx: RTMRs are zero, PCRs pinned instead
            t.add_row(reg.upper(), "\n".join(r[reg]))
    for index, values in (r.get("pcrs") or {}).items():
        t.add_row(f"PCR {index} (SHA-256)", "\n".join(values))
    for e in r["rtmr3_events"]:
        value = e.get("digest", f"launch-bound: {e['describes']}")
        t.add_row(f"RTMR3 event {e['name']}", value)
    inst = r.get("instance")
    if inst:
        for e in inst["events"]:
            t.add_row(
                f"{inst['cvm_id']}: {e['name']}", f"payload {e['payload']}\ndigest {e['digest']}"
            )
        if inst["expected_rtmr3"] is not None:
            t.add_row(f"{inst['cvm_id']}: expected RTMR3", inst["expected_rtmr3"])
        else:
            t.add_row(f"{inst['cvm_id']}: RTMR3 before boot events", inst["rtmr3_before_boot"])
            t.add_row(f"{inst['cvm_id']}: then, per boot", ", ".join(inst["per_boot_events"]))
    console.print(t)
    if r["tee"] == "simulated":
        console.print("[bold magenta]SIMULATED TEE: these values prove nothing about hardware.[/]")
    if "written_to" in r:
        console.print(f"wrote {r['written_to']}")


@app.command("verify-manifest")
def verify_manifest_cmd(
    signed: Annotated[Path, typer.Argument(help="measurement-manifest.signed.json")],
    key: Annotated[
        list[Path], typer.Option("--key", "-k", help="Pinned Ed25519 public key (PEM).")
    ],
    as_json: JsonFlag = False,
) -> None:
    """Check a signed measurement manifest against pinned release keys."""
    from umbra.images.signing import SignatureError, load_public_key, verify_signed_manifest

    try:
        keys = [load_public_key(k) for k in key]
        manifest = verify_signed_manifest(signed.read_bytes(), keys)
    except OSError as exc:
        fail(f"cannot read {signed}: {exc.strerror}", EXIT_USAGE, as_json=as_json)
    except SignatureError as exc:
        fail(str(exc), as_json=as_json)
    if as_json:
        print_json(
            {"ok": True, "release": manifest.release.name, "compose_hash": manifest.compose_hash}
        )
    else:
        console.print(
            f"[bold green]OK[/] {manifest.release.name}: compose-hash {manifest.compose_hash}"
        )


@app.command("keygen")
def keygen_cmd(
    out: Annotated[Path, typer.Argument(help="Private key path; the public key goes to OUT.pub.")],
) -> None:
    """Create an Ed25519 release signing key (private key mode 0600)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from umbra.contracts.keys import KeyFileError, write_key_pair

    try:
        public = write_key_pair(Ed25519PrivateKey.generate(), out)
    except (KeyFileError, OSError) as exc:
        fail(str(exc), EXIT_USAGE)
    console.print(f"wrote {out} and {public}")


def _git_commit() -> str:
    import subprocess

    done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    return done.stdout.strip() if done.returncode == 0 else "unknown"


@app.command("build")
def build_cmd(
    rootfs: Annotated[str, typer.Argument(help="runtime (the service images' rootfs)")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Write image archives here.")],
    wheel: Annotated[Path, typer.Option("--wheel", help="The umbra wheel (uv build --wheel).")],
    requirements: Annotated[
        Path, typer.Option("--requirements", help="uv export --frozen --no-dev (with hashes).")
    ],
    sign_key: Annotated[
        Path | None, typer.Option("--sign-key", help="Ed25519 key for the provenance (PEM).")
    ] = None,
    epoch: Annotated[
        int | None, typer.Option("--source-date-epoch", help="Default: $SOURCE_DATE_EPOCH.")
    ] = None,
    update_lock: Annotated[
        bool, typer.Option("--update-lock", help="Rewrite images/packages.lock from this build.")
    ] = False,
    lock_policy: LockPolicyOption = LockPolicy.STRICT,
    builder_id: Annotated[str, typer.Option("--builder-id")] = "local",
    pulumi_cli: Annotated[
        Path | None,
        typer.Option("--pulumi-cli", help="The Pulumi CLI tarball (linux-x64) for the Console."),
    ] = None,
    pulumi_version: Annotated[
        str | None, typer.Option("--pulumi-version", envvar="PULUMI_VERSION")
    ] = None,
    pulumi_sha256: Annotated[
        str | None,
        typer.Option(
            "--pulumi-sha256", envvar="PULUMI_SHA256", help="The tarball's pinned SHA-256."
        ),
    ] = None,
    without_tools: Annotated[
        bool,
        typer.Option("--without-tools", help="Development: no Pulumi CLI or policy pack layer."),
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """Build the images of one rootfs reproducibly; write provenance (signed with --sign-key)."""
    import sys

    from umbra.images.build import BuildError, build_rootfs
    from umbra.images.provenance import sign_statement, statement
    from umbra.images.recipes import Rootfs
    from umbra.images.signing import SignatureError, load_private_key
    from umbra.sandbox.render import canonical_json

    try:
        kind = Rootfs(rootfs)
    except ValueError:
        fail(f"unknown rootfs {rootfs!r}: want one of {[r.value for r in Rootfs]}", EXIT_USAGE)
    when = epoch if epoch is not None else int(os.environ.get("SOURCE_DATE_EPOCH", "0") or 0)
    if when <= 0:
        fail("give --source-date-epoch or SOURCE_DATE_EPOCH (e.g. the commit time)", EXIT_USAGE)
    tools = None
    if pulumi_cli is not None:
        from pydantic import ValidationError

        from umbra.images.console_tools import ConsoleTools, PulumiPin

        try:
            pin = PulumiPin(version=pulumi_version or "", sha256=pulumi_sha256 or "")
        except ValidationError:
            fail(
                "--pulumi-cli needs --pulumi-version X.Y.Z and --pulumi-sha256 (64 hex)",
                EXIT_USAGE,
            )
        tools = ConsoleTools(pulumi_cli, pin)
    key = None
    try:
        key = load_private_key(sign_key) if sign_key is not None else None
        result = build_rootfs(
            kind,
            out,
            wheel=wheel,
            requirements=requirements,
            host_python_prefix=Path(sys.base_prefix),
            epoch=when,
            update_lock=update_lock,
            lock_policy=lock_policy,
            tools=tools,
            without_tools=without_tools,
        )
    except (BuildError, SignatureError) as exc:
        fail(str(exc), as_json=as_json)
    st = statement(
        result,
        source_repo=os.environ.get("GITHUB_REPOSITORY", "umbra"),
        source_commit=_git_commit(),
        builder_id=builder_id,
        command=["umbra", "image", "build", rootfs],
    )
    images = {
        i.name: {
            "ref": i.ref,
            "manifest_digest": i.manifest_digest,
            "config_digest": i.config_digest,
            "archive": i.archive.name,
        }
        for i in result.images
    }
    _write(out / f"images.{kind}.json", canonical_json(images) + "\n")
    unsigned = canonical_json(st.model_dump(mode="json", by_alias=True)) + "\n"
    _write(out / f"provenance.{kind}.intoto.json", unsigned)
    if key is not None:
        _write(out / f"provenance.{kind}.dsse.json", sign_statement(st, key))
    if as_json:
        drift = [d.line() for d in result.lock_drift]
        print_json(
            {"rootfs": str(kind), "images": images, "signed": key is not None, "lock_drift": drift}
        )
        return
    for name, i in images.items():
        console.print(f"{name}: {i['ref']} (image id {i['config_digest']})")


@app.command("verify")
def verify_cmd(
    signed: Annotated[Path, typer.Argument(help="measurement-manifest.signed.json")],
    key: Annotated[list[Path], typer.Option("--key", "-k", help="Pinned release key (PEM).")],
    provenance: Annotated[
        list[Path], typer.Option("--provenance", "-p", help="DSSE provenance envelope(s).")
    ],
    commit: Annotated[str, typer.Option("--commit", help="The source commit expected.")],
    as_json: JsonFlag = False,
) -> None:
    """Check a release: its signed manifest, and signed provenance from `--commit` for each of
    its images (each envelope's SHA-256 as the manifest names it)."""
    import hashlib

    from umbra.images.provenance import ProvenanceError, verify_release_images
    from umbra.images.signing import SignatureError, load_public_key, verify_signed_manifest

    try:
        keys = [load_public_key(k) for k in key]
        manifest = verify_signed_manifest(signed.read_bytes(), keys)
        envelopes = [p.read_bytes() for p in provenance]
    except OSError as exc:
        fail(f"cannot read {exc.filename}: {exc.strerror}", EXIT_USAGE, as_json=as_json)
    except SignatureError as exc:
        fail(str(exc), as_json=as_json)
    if not manifest.images:
        fail(f"{manifest.release.name}: the manifest names no images", as_json=as_json)
    sums = {hashlib.sha256(e).hexdigest() for e in envelopes}
    for name, entry in sorted(manifest.images.items()):
        if entry.provenance_sha256 is None or entry.provenance_sha256 not in sums:
            fail(
                f"{name}: the manifest's provenance for {entry.digest} was not given",
                as_json=as_json,
            )
    try:
        covered = verify_release_images(
            {n: e.digest for n, e in manifest.images.items()}, envelopes, keys, commit
        )
    except ProvenanceError as exc:
        fail(str(exc), as_json=as_json)
    if as_json:
        print_json({"ok": True, "release": manifest.release.name, "images": sorted(covered)})
    else:
        console.print(
            f"[bold green]OK[/] {manifest.release.name}: {len(covered)} images built from {commit}"
        )


@app.command("launch-agent")
def launch_agent_cmd(
    cloud: Annotated[
        str,
        typer.Option("--cloud", help="gcp | azure | smbios (the firmware's system vendor says)"),
    ],
    tee: Annotated[
        str,
        typer.Option(
            "--tee",
            help="tdx | emulated (the emulated clouds: the host's simulated TDX module over "
            "virtio-serial) | simulated (the event log only)",
        ),
    ] = "tdx",
    metadata_url: Annotated[
        str | None, typer.Option("--metadata-url", help="Metadata service base URL (tests).")
    ] = None,
    user_data_file: Annotated[
        Path | None, typer.Option("--user-data-file", help="Azure: read the user data here.")
    ] = None,
    launch_dir: Annotated[Path, typer.Option("--launch-dir")] = Path("/run/umbra/launch"),
    serial: Annotated[Path, typer.Option("--console", help="Serial console device.")] = Path(
        "/dev/ttyS0"
    ),
    compose: Annotated[
        str | None,
        typer.Option(
            "--compose",
            help="Another compose command (space-separated, tests); default: the image's "
            "docker-compose runner.",
        ),
    ] = None,
    images_dir: Annotated[
        Path, typer.Option("--images-dir", help="The image archives shipped in the OS image.")
    ] = IMAGES_DIR,
    state_dir: Annotated[
        Path, typer.Option("--state-dir", help="Where lowered compose files and configs go.")
    ] = Path("/run/umbra/compose"),
    allow_missing_tsm: Annotated[
        bool,
        typer.Option(
            "--allow-missing-tsm",
            help="Development only: a machine without configfs-tsm drops the compose's quote "
            "mount (the service cannot quote) instead of refusing.",
        ),
    ] = False,
    report_ready: Annotated[bool, typer.Option("--report-ready/--no-report-ready")] = True,
    data_disk: Annotated[
        str | None,
        typer.Option(
            "--data-disk",
            help="The persistent disk (default: the one unpartitioned disk, found in sysfs), or "
            "'none'.",
        ),
    ] = None,
    dev_host_root: Annotated[
        Path,
        typer.Option(
            "--dev-host-root",
            help="Dev CVMs: the sandbox's directory (on the data disk; umbra sandbox host up).",
        ),
    ] = Path("/var/lib/umbra/data/dev-host"),
    sandbox_image_dir: Annotated[
        Path,
        typer.Option("--sandbox-image-dir", help="Dev CVMs: the sandbox image the OS ships."),
    ] = Path("/usr/lib/umbra/sandbox-image"),
    idle_stop: Annotated[
        bool,
        typer.Option(
            "--idle-stop/--no-idle-stop",
            help="Dev CVMs: arm the image's idle auto-stop timer (umbra-idle.timer).",
        ),
    ] = True,
    spool_dir: Annotated[
        Path,
        typer.Option(
            "--spool-dir",
            help="Security CVMs: the directory the compose's spool volume binds (created).",
        ),
    ] = Path("/var/lib/umbra/data/spool"),
    ingress: Annotated[
        bool,
        typer.Option(
            "--ingress/--no-ingress",
            help="Dev CVMs: start the attested SSH ingress (umbra-ingress.service) after the "
            "compose. --no-ingress: no SSH at all (the boot test's compose stub).",
        ),
    ] = True,
    simulated_pki: Annotated[
        Path | None,
        typer.Option(
            "--simulated-pki",
            help="With --tee simulated: the PKI the ingress's simulated quotes are signed by.",
        ),
    ] = None,
    ccel: Annotated[
        Path | None,
        typer.Option(
            "--ccel",
            help="With --tee tdx: the firmware's event log (the ACPI CCEL table's log area; "
            "default /sys/firmware/acpi/tables/data/CCEL).",
        ),
    ] = None,
) -> None:
    """Boot-time: read launch data, measure it into RTMR3, write /run/umbra/launch, start the
    compose, report ready. Refuses (exit 1, reason on the serial console) on bad launch data."""
    from umbra.images import launch_agent as la
    from umbra.images import launch_host as lh
    from umbra.images import launch_ingress as li
    from umbra.images import launch_secrets as ls
    from umbra.images.launch_host import DataDisk, DiscoveredDataDisk, Ext4DataDisk
    from umbra.images.launch_quote_relay import SystemdQuoteRelay
    from umbra.sandbox.render import SERVICE_UID

    source: la.MetadataSource
    reporter: la.Reporter | None
    secrets: ls.SecretReader
    if cloud == "smbios":
        from umbra.images.cloud_id import UnknownCloud, cloud_from_smbios

        try:
            cloud = cloud_from_smbios()
        except UnknownCloud as exc:
            la.serial_console(serial)(f"umbra-launch: REFUSED, nothing started: {exc}")
            raise typer.Exit(1) from None
    if cloud == "gcp":
        source = la.GcpMetadata(metadata_url or la.GCP_METADATA)
        reporter = la.GcpGuestAttribute(metadata_url or la.GCP_METADATA)
        secrets = ls.GcpSecretManager(metadata_url or ls.METADATA)
    elif cloud == "azure":
        source = la.AzureUserData(metadata_url or la.AZURE_IMDS, user_data_file)
        reporter = la.AzureWireServer()
        secrets = ls.AzureKeyVault(metadata_url or ls.METADATA)
    else:
        fail(f"--cloud must be gcp, azure or smbios, got {cloud!r}", EXIT_USAGE)
    extender: la.Extender
    firmware_log: Callable[[], Sequence[Event]] | None = None
    if ccel is not None and tee != "tdx":
        fail("--ccel is only for --tee tdx", EXIT_USAGE)
    if tee == "tdx":
        from umbra.images.launch_ccel import CCEL_DATA, CcelReader

        extender = la.SysfsRtmr()
        firmware_log = CcelReader(ccel or CCEL_DATA)
    elif tee == "emulated":
        module = la.TdxModuleRtmr()
        extender, firmware_log = module, module.firmware_events
    elif tee == "simulated":
        extender = la.LogOnly()  # the simulated quote source replays the written event log
    else:
        fail(f"--tee must be tdx, emulated or simulated, got {tee!r}", EXIT_USAGE)
    # The ingress quotes where the agent measured: configfs-tsm on TDX, the host's module on the
    # emulated clouds (both serve the agent's event log).
    quote_source: dict[str, str] = {"kind": "emulated" if tee == "emulated" else "configfs"}
    if tee == "simulated":
        if ingress and simulated_pki is None:
            fail(
                "--tee simulated needs --simulated-pki for the ingress (or --no-ingress)",
                EXIT_USAGE,
            )
        quote_source = {"kind": "simulated", "simulated_pki": str(simulated_pki)}
    elif simulated_pki is not None:
        fail("--simulated-pki is only for --tee simulated", EXIT_USAGE)
    say = la.serial_console(serial)
    disk: DataDisk | None = None
    if data_disk == "none":
        disk = None
    elif data_disk:
        disk = Ext4DataDisk(Path(data_disk), la.DATA_MOUNT)
    else:  # found in sysfs: the clouds' udev names need their guest agents' rules
        disk = DiscoveredDataDisk(la.DATA_MOUNT)
    starter: la.Starter = (
        la.DockerCompose(tuple(compose.split()))
        if compose
        else la.ComposeRunnerStart(images_dir, state_dir, allow_missing_tsm, say)
    )
    dev_host = la.DevHostStart(dev_host_root, sandbox_image_dir)
    agent = la.Agent(
        source=source,
        extender=extender,
        starter=starter,
        reporter=reporter if report_ready else None,
        launch_dir=launch_dir,
        say=say,
        data_disk=disk,
        dev_host=None if compose else dev_host,
        spool_dir=spool_dir,
        ingress=li.AttestedIngress(
            li.PidFileSandbox(dev_host.sandbox_pid_file()), li.SystemdUnit(), quote_source
        )
        if ingress
        else None,
        cloud=cloud,
        idle_stop=la.SystemdIdleStop() if idle_stop else None,
        firmware_log=firmware_log,
        quote_relay=SystemdQuoteRelay(SERVICE_UID) if tee == "emulated" else None,
        secrets=ls.Retrying(secrets, say=say),
        local_routes=lh.LocalRoutes(),
    )
    try:
        agent.run()
    except la.LaunchError:
        raise typer.Exit(1) from None


@app.command("tdx-quote-relay")
def tdx_quote_relay_cmd(
    socket: Annotated[Path, typer.Option("--socket", help="The unix socket to serve on.")],
    uid: Annotated[int, typer.Option("--uid", help="The socket's owner (the proxy's uid).")],
) -> None:
    """Emulated clouds, Security CVM: serve quotes only from the host's TDX module to the
    proxy (started by the launch agent with --tee emulated; images/launch_quote_relay.py)."""
    from umbra.attest.tdx_port import TdxModulePort, serve_quote_relay

    try:
        serve_quote_relay(socket, TdxModulePort(wait=60.0), uid)
    except OSError as exc:
        fail(f"{socket}: {exc.strerror or exc}", EXIT_USAGE)


@app.command("os-build")
def os_build_cmd(
    definition: Annotated[Path, typer.Argument(help="images/os/gcp.yaml | azure.yaml | qemu.yaml")],
    out: Annotated[Path, typer.Option("--out", "-o", help="The OS image directory to write.")],
    wheel: Annotated[Path, typer.Option("--wheel", help="The umbra wheel (uv build --wheel).")],
    requirements: Annotated[
        Path, typer.Option("--requirements", help="uv export --frozen --no-dev (with hashes).")
    ],
    epoch: Annotated[
        int | None, typer.Option("--source-date-epoch", help="Default: $SOURCE_DATE_EPOCH.")
    ] = None,
    image_archive: Annotated[
        list[Path] | None,
        typer.Option("--image-archive", help="A release image archive to ship (repeatable)."),
    ] = None,
    update_lock: Annotated[
        bool,
        typer.Option(
            "--update-lock", help="Rewrite this definition's lines of images/os/packages.lock."
        ),
    ] = False,
    lock_policy: LockPolicyOption = LockPolicy.STRICT,
    as_json: JsonFlag = False,
) -> None:
    """Build the CVM OS image of one definition (Debian 13 + the backports TDX guest kernel):
    rootfs.ext4, vmlinuz, initrd.img and the UEFI stub, which `umbra image disks` packs."""
    import sys

    from umbra.images.build import BuildError
    from umbra.images.os_image import build_os_image, load_os_definition

    when = epoch if epoch is not None else int(os.environ.get("SOURCE_DATE_EPOCH", "0") or 0)
    if when <= 0:
        fail("give --source-date-epoch or SOURCE_DATE_EPOCH (e.g. the commit time)", EXIT_USAGE)
    try:
        image = build_os_image(
            load_os_definition(definition),
            out,
            wheel=wheel,
            requirements=requirements,
            host_python_prefix=Path(sys.base_prefix),
            epoch=when,
            image_archives=image_archive or (),
            update_lock=update_lock,
            lock_policy=lock_policy,
        )
    except BuildError as exc:
        fail(str(exc), as_json=as_json)
    result = {k: str(getattr(image, k)) for k in ("rootfs", "kernel", "initrd", "stub")}
    if as_json:
        print_json(result | {"lock_drift": [d.line() for d in image.lock_drift]})
        return
    for k, v in result.items():
        console.print(f"{k}: {v}")


@app.command("disks")
def disks_cmd(
    os_dir: Annotated[
        Path,
        typer.Argument(
            help="The OS image build's directory: rootfs.ext4, vmlinuz, initrd.img, "
            "linuxx64.efi.stub."
        ),
    ],
    out: Annotated[Path, typer.Option("--out", help="Directory for the UKI and the disks.")],
    source_date_epoch: Annotated[
        int, typer.Option("--source-date-epoch", help="Timestamps in the ESP and GCP tarball.")
    ] = 0,
    sb_key: Annotated[
        Path | None,
        typer.Option("--sb-key", help="The release's Secure Boot key (PEM, RSA-2048)."),
    ] = None,
    sb_cert: Annotated[
        Path | None,
        typer.Option("--sb-cert", help="Its certificate (PEM): the image's Secure Boot db."),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Pack the OS image as bootable cloud disks (ESP with a UKI + root + the root's dm-verity
    hash tree): GCP disk.raw in a .tar.gz, Azure fixed VHD. Prints the UKI's digests (its
    Authenticode hash is what the firmware measures into RTMR1) and the verity root hash its
    command line carries. With --sb-key/--sb-cert the UKI is signed for Secure Boot and
    secure-boot-db.json holds the certificate as GCP's and Azure's image Secure Boot state."""
    from umbra.contracts.files import write_atomic
    from umbra.images.disk_formats import DiskFormatError
    from umbra.images.secure_boot import SECURE_BOOT_DB_NAME, secure_boot_db
    from umbra.images.uki import UkiSigner, kernel_cmdline, pack_os_image

    if (sb_key is None) != (sb_cert is None):
        fail("--sb-key and --sb-cert go together", EXIT_USAGE, as_json=as_json)
    signer = UkiSigner(sb_key, sb_cert) if sb_key is not None and sb_cert is not None else None
    try:
        db = secure_boot_db(signer.cert) if signer is not None else None
        uki, disks = pack_os_image(os_dir, out, source_date_epoch, signer)
        if db is not None:
            text = json.dumps(db.document(), indent=2, sort_keys=True) + "\n"
            write_atomic(out / SECURE_BOOT_DB_NAME, text, 0o644)
    except DiskFormatError as exc:
        fail(str(exc), EXIT_USAGE, as_json=as_json)
    except OSError as exc:
        fail(f"{exc.filename}: {exc.strerror}", EXIT_USAGE, as_json=as_json)
    result = {
        "raw": str(disks.raw),
        "raw_sha256": disks.raw_sha256,
        "gcp": str(disks.gcp_tar_gz),
        "azure": str(disks.azure_vhd),
        "uki": str(uki.path),
        "uki_sha256": uki.sha256,
        "uki_authenticode_sha384": uki.authenticode_sha384,
        "uki_authenticode_sha256": uki.authenticode_sha256,
        "cmdline": kernel_cmdline(disks.verity_root_hash),
        "verity_root_hash": disks.verity_root_hash,
        "secure_boot_cert_sha256": db.cert_sha256 if db is not None else None,
    }
    if as_json:
        print_json(result)
        return
    for k, v in result.items():
        console.print(f"{k}: {v}")


@app.command("os-release")
def os_release_cmd(
    disks: Annotated[Path, typer.Argument(help="`umbra image disks --json` output.")],
    sb_cert: Annotated[
        Path, typer.Option("--sb-cert", help="The release's Secure Boot certificate (PEM).")
    ],
    version: Annotated[str, typer.Option("--version", help="MAJOR.MINOR.PATCH")],
    targets: Annotated[
        Path,
        typer.Option(
            "--targets",
            help="JSON: {gcp: {project, tarball_url}, azure: {resource_group, location, gallery, "
            "storage_account_id, vhd_url}}, where the workflow uploaded the disks.",
        ),
    ],
) -> None:
    """The images stack's release document (umbra-images:release): one line of JSON."""
    from umbra.images.publish import PublishError, os_release, release_json
    from umbra.images.secure_boot import SecureBootError

    try:
        disks_doc = json.loads(disks.read_text())
        targets_doc = json.loads(targets.read_text())
    except (OSError, ValueError) as exc:
        fail(f"cannot read the inputs: {exc}", EXIT_USAGE)
    if not isinstance(disks_doc, dict) or not isinstance(targets_doc, dict):
        fail(f"{disks} and {targets} must be JSON objects", EXIT_USAGE)
    try:
        release = os_release(disks_doc, sb_cert, version, targets_doc)
    except (PublishError, SecureBootError) as exc:
        fail(str(exc), EXIT_USAGE)
    print(release_json(release))
