"""Client side of the attested SSH ingress: from the Console's `SessionInfo` to a verified aTLS
connection and the host key the quote binds. Kept free of typer/rich so the ProxyCommand starts
fast. Order of checks: docs/specs/session.md.
"""

from __future__ import annotations

import base64
import binascii
import enum
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from umbra.attest.atls import ATLSConnection, atls_connect
from umbra.attest.collateral import CollateralSource, PccsCollateral, StaticCollateral
from umbra.attest.errors import ATLSError, AttestError
from umbra.attest.eventlog import RUNTIME_EVENT_TYPE, Event
from umbra.attest.measurement import (
    SSH_KEYS_EVENT,
    ExpectedEvent,
    InstanceBinding,
    MeasurementPolicy,
    canonical_ssh_key,
)
from umbra.attest.session_info import SessionInfo
from umbra.attest.verify import Verdict, Verifier
from umbra.contracts.session import (
    BOOT_ID_EVENT,
    CVM_ID_EVENT,
    HOST_FIREWALL_EVENT,
    SSH_HOST_KEY_EVENT,
    SessionState,
)

SIMULATED_PKI_ENV = "UMBRA_SIMULATED_PKI"  # opt in to simulated TEEs (the embedded default)
PCCS_ENV = "UMBRA_PCCS_URL"
DEFAULT_PCCS = "https://api.trustedservices.intel.com"


class Check(enum.StrEnum):
    """The check that refused a session; the one word the refusal line leads with."""

    console = "console"
    cvm_state = "cvm-state"
    launch_data = "launch-data"
    ingress = "ingress"
    atls = "atls"
    release = "release"
    measurement = "measurement"
    cvm_id = "cvm-id"
    authorized_keys = "authorized-keys"
    host_firewall = "host-firewall"
    host_key = "host-key"
    host_key_binding = "host-key-binding"
    host_key_pin = "host-key-pin"
    freshness = "freshness"
    simulated = "simulated"


class Refused(Exception):
    def __init__(self, check: Check, reason: str) -> None:
        self.check = check
        self.reason = reason
        super().__init__(f"{check}: {reason}")


def session_policy(info: SessionInfo) -> MeasurementPolicy:
    """The release's golden values plus this launch: exactly this CVM id, exactly these keys,
    the host firewall ruleset it was launched with (if any), and one boot id and host-key event
    (whose payloads the client then reads from the verified log)."""
    if info.state != SessionState.running:
        raise Refused(Check.cvm_state, f"CVM {info.cvm_id} is {info.state}, not running")
    if info.release is None:
        raise Refused(
            Check.launch_data, f"the Console records no release manifest for {info.cvm_id}"
        )
    if not info.ssh_authorized_keys:
        raise Refused(Check.launch_data, f"no SSH keys were bound at launch of {info.cvm_id}")
    pinned_id = ExpectedEvent(name=CVM_ID_EVENT, payloads=[info.cvm_id.encode().hex()])
    release_events: list[ExpectedEvent] = []
    binding_events: list[ExpectedEvent] = []
    names = {e.name for e in info.release.events}
    for event in info.release.events:
        release_events.append(pinned_id if event.name == CVM_ID_EVENT else event)
    if CVM_ID_EVENT not in names:
        binding_events.append(pinned_id)
    for name in (BOOT_ID_EVENT, SSH_HOST_KEY_EVENT):
        if name not in names:
            binding_events.append(ExpectedEvent(name=name))
    if info.host_firewall_sha256 is not None:
        # Pinned: a firewall event with another ruleset, or none, is refused. Without a launch
        # record of one, a firewall event is an unexpected runtime event: refused just the same.
        binding_events.append(
            ExpectedEvent(name=HOST_FIREWALL_EVENT, payloads=[info.host_firewall_sha256])
        )
    release = info.release.model_copy(update={"events": release_events})
    binding = InstanceBinding(
        apiVersion="umbra/v1",
        kind="InstanceBinding",
        release=release.name,
        instance_id=info.cvm_id,
        ssh_authorized_keys=list(info.ssh_authorized_keys),
        events=binding_events,
    )
    return MeasurementPolicy(release=release, binding=binding)


class CapturingVerifier(Verifier):
    """A Verifier that keeps the verdict and the event log it verified (for the host key)."""

    verdict: Verdict | None = None
    log: list[Event] | None = None

    def verify(
        self,
        raw_quote: bytes,
        *,
        event_log: Sequence[Event] | None = None,
        expected_report_data: bytes | None = None,
        now: int | None = None,
        relayed_collateral: bytes | None = None,
    ) -> Verdict:
        verdict = super().verify(
            raw_quote,
            event_log=event_log,
            expected_report_data=expected_report_data,
            now=now,
            relayed_collateral=relayed_collateral,
        )
        self.verdict = verdict
        self.log = list(event_log) if event_log is not None else None
        return verdict


def collateral_and_root(simulated: bool) -> tuple[CollateralSource, bytes | None]:
    """Trust roots are the client's own: never from the Console."""
    pki_dir = os.environ.get(SIMULATED_PKI_ENV)
    if simulated and not pki_dir:
        from umbra.cli.credentials import embedded_client

        local = embedded_client()  # `umbra up`'s opt-in, for its own Console only
        pki_dir = local.simulated_pki if local is not None else None
    if simulated:
        if not pki_dir:
            raise Refused(
                Check.simulated,
                f"the release is tee: simulated; set {SIMULATED_PKI_ENV} to trust a local "
                "simulated TEE (never for production)",
            )
        import time

        from umbra.attest.simpki import SimulatedPki

        try:
            pki = SimulatedPki.load(Path(pki_dir))
        except AttestError as exc:
            raise Refused(Check.simulated, str(exc)) from None
        return StaticCollateral(pki.collateral(int(time.time()) - 60)), pki.root_der
    return PccsCollateral([os.environ.get(PCCS_ENV) or DEFAULT_PCCS]), None


def classify(reasons: Sequence[str]) -> Check:
    text = " ".join(reasons)
    for needle, check in (
        ("simulated", Check.simulated),
        ("report_data", Check.freshness),
        (CVM_ID_EVENT, Check.cvm_id),
        (SSH_KEYS_EVENT, Check.authorized_keys),
        (SSH_HOST_KEY_EVENT, Check.host_key),
        (HOST_FIREWALL_EVENT, Check.host_firewall),
        ("MRTD", Check.release),
        ("RTMR", Check.measurement),
    ):
        if needle in text:
            return check
    return Check.measurement


def _one(log: Sequence[Event] | None, name: str) -> bytes:
    hits = [e for e in log or () if e.event_type == RUNTIME_EVENT_TYPE and e.name == name]
    if len(hits) != 1:
        raise Refused(Check.host_key, f"the quote binds {len(hits)} {name} events, not one")
    return hits[0].payload


def attested_host_key(log: Sequence[Event] | None) -> str:
    try:
        return canonical_ssh_key(_one(log, SSH_HOST_KEY_EVENT).decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise Refused(Check.host_key, f"the bound host key is not an SSH key: {exc}") from None


def attested_boot_id(log: Sequence[Event] | None) -> str:
    boot = _one(log, BOOT_ID_EVENT).decode(errors="replace")
    if not (len(boot) == 32 and all(c in "0123456789abcdef" for c in boot)):
        raise Refused(Check.host_key, f"the bound {BOOT_ID_EVENT} is not 16 bytes of hex")
    return boot


def fingerprint(key_line: str) -> str:
    """OpenSSH's SHA256 fingerprint of a `type base64` key line (for messages)."""
    try:
        blob = base64.b64decode(key_line.split()[1], validate=True)
    except (IndexError, binascii.Error):
        return "(not a key)"
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def check_host_key(
    cvm_id: str, log: Sequence[Event] | None, binding: bytes | None
) -> tuple[str, str]:
    """The attested host key and boot id, once the three views agree: the RTMR3 event, the key
    the ingress bound into this session's report_data (the one it hands sshd), and our pin for
    this CVM and boot. Raises Refused naming the view that differs."""
    from umbra.cli.credentials import pinned_host_key

    key, boot = attested_host_key(log), attested_boot_id(log)
    if binding is None:
        raise Refused(
            Check.host_key_binding, "the ingress bound no host key into this session's quote"
        )
    try:
        bound = canonical_ssh_key(binding.decode())
    except (UnicodeDecodeError, ValueError):
        raise Refused(Check.host_key_binding, "the session's binding is not an SSH key") from None
    if bound != key:
        raise Refused(
            Check.host_key_binding,
            f"the ingress would hand sshd host key {fingerprint(bound)}, but this boot attested "
            f"{fingerprint(key)} (the key file changed after boot)",
        )
    pin = pinned_host_key(cvm_id)
    if pin is not None and pin.boot_id == boot and pin.key != key:
        raise Refused(
            Check.host_key_pin,
            f"boot {boot[:8]} of {cvm_id} was pinned with host key {fingerprint(pin.key)}, "
            f"now attests {fingerprint(key)}",
        )
    return key, boot


@dataclass
class AttestedSession:
    conn: ATLSConnection
    host_key: str
    boot_id: str
    verdict: Verdict


async def connect_attested(info: SessionInfo, handshake_timeout: float = 20.0) -> AttestedSession:
    policy = session_policy(info)
    if info.ingress is None:
        raise Refused(Check.launch_data, f"the Console records no SSH ingress for {info.cvm_id}")
    collateral, root = collateral_and_root(policy.tee == "simulated")
    verifier = CapturingVerifier(
        policy, collateral, allow_simulated=root is not None, simulated_root_der=root
    )
    refused: list[Refused] = []
    identity: list[tuple[str, str]] = []

    def accept(_verdict: Verdict, binding: bytes | None) -> list[str]:
        # runs before our VERDICT: a refusal here means the ingress never starts sshd
        try:
            identity.append(check_host_key(info.cvm_id, verifier.log, binding))
        except Refused as exc:
            refused.append(exc)
            return [f"{exc.check}: {exc.reason}"]
        return []

    try:
        conn = await atls_connect(
            info.ingress.host,
            info.ingress.port,
            verifier,
            handshake_timeout=handshake_timeout,
            accept=accept,
        )
    except ATLSError as exc:
        if refused:
            raise refused[0] from None
        verdict = verifier.verdict
        if verdict is not None and not verdict.ok:
            raise Refused(classify(verdict.reasons), "; ".join(verdict.reasons)) from None
        check = Check.ingress if "cannot connect" in str(exc) else Check.atls
        raise Refused(check, str(exc)) from None
    assert verifier.verdict is not None and identity
    host_key, boot_id = identity[0]
    return AttestedSession(conn, host_key, boot_id, verifier.verdict)
