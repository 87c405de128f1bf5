"""The Dev CVM's tunnel credential, only after attestation (attest/enroll_client.py).

The forwarder (or, on one machine, the local provider before it starts the forwarder: the
Console listens on loopback, which the forwarder's namespace cannot reach) trades the one-time
token from launch data for the tunnel credential. The key is generated here and bound into this
TD's quote with the CVM id; the Console checks the quote against the Dev CVM image's release and
seals the credential to the key. The credential is kept in `credential_file` (0600); a restart
of the forwarder uses it and never spends the token again; a reboot, which loses it (tmpfs),
re-enrolls by a fresh quote of the same launch (console/reenrollment.py).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from umbra.attest.enroll_client import BOOT_RETRY_DELAYS, EnrollError, ensure_credential
from umbra.attest.errors import AttestError
from umbra.attest.eventlog import Event, load_event_log
from umbra.attest.quote_source import (
    ConfigfsTsmSource,
    QuoteSource,
    QuoteSourceKind,
    SimulatedSource,
)
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx
from umbra.attest.tdx_port import TdxModuleSource
from umbra.contracts.session import CVM_ID_EVENT
from umbra.sandbox.forwarder_config import (
    Enrollment,
    ForwarderConfig,
    ForwarderConfigError,
    read_cvm_id,
    read_first_ipv4,
)


def _quoter(enrollment: Enrollment, cvm_id: str) -> tuple[QuoteSource, Sequence[Event] | None]:
    if enrollment.quote_source is QuoteSourceKind.simulated:
        assert enrollment.simulated_pki is not None  # the config requires it
        try:
            tdx = SimulatedTdx(
                SimulatedPki.load(enrollment.simulated_pki), image=enrollment.simulated_image
            )
        except (OSError, AttestError, ValueError) as exc:
            raise ForwarderConfigError(f"{enrollment.simulated_pki}: {exc}") from None
        # What the launch agent measures before anything starts: the CVM id.
        tdx.extend_runtime_event(CVM_ID_EVENT, cvm_id.encode())
        return SimulatedSource(tdx), tdx.event_log()
    events = None
    if enrollment.event_log is not None:
        try:
            events = load_event_log(enrollment.event_log.read_bytes())
        except (OSError, AttestError) as exc:
            raise ForwarderConfigError(f"{enrollment.event_log}: {exc}") from None
    if enrollment.quote_source is QuoteSourceKind.emulated:
        return TdxModuleSource(), events
    return ConfigfsTsmSource(), events


def read_console_address(path: Path) -> str:
    """The first IPv4 address of the launch agent's console-ips file (space/line separated)."""
    return read_first_ipv4(path, "Console")


def ensure_tunnel_credential(cfg: ForwarderConfig) -> bool:
    """Enroll when configured and no credential is stored yet; returns whether it enrolled now.
    Raises ForwarderConfigError (the message names the cause, never the token)."""
    if cfg.enrollment is None:
        return False
    assert cfg.credential_file is not None  # the config requires it with enrollment
    enrollment, cvm_id = cfg.enrollment, read_cvm_id(cfg.cvm_id_file)
    if cfg.credential_file.exists():
        return False  # enrolled before: no quote, no Console call
    address = (
        read_console_address(enrollment.console_ips_file) if enrollment.console_ips_file else None
    )
    source, events = _quoter(enrollment, cvm_id)
    try:
        _credential, enrolled = ensure_credential(
            console_url=enrollment.console_url,
            cvm_id=cvm_id,
            token_file=enrollment.token_file,
            credential_file=cfg.credential_file,
            quoter=lambda report_data: (source.get_quote(report_data), events),
            verify=str(enrollment.console_ca) if enrollment.console_ca else True,
            connect_address=address,
            # A reboot lost the credential (tmpfs): re-enroll by a fresh quote of this launch.
            launch_events=events,
            # At boot the Console may not answer yet (or ever): retried, then failed with why.
            retry_delays=BOOT_RETRY_DELAYS,
            say=lambda line: print(line, file=sys.stderr, flush=True),
        )
    except EnrollError as exc:
        raise ForwarderConfigError(f"enrollment: {exc}") from None
    return enrolled
