"""The Security CVM's Console credential, only after attestation: at start, with
`--enroll-token-file`, the proxy enrolls (a key generated here, a quote from this TD's quote
source binding it) and persists the sealed credential it receives to `--console-credential-file`
(0600). Later starts use the stored credential and never spend the token again
(attest/enroll_client.py); a reboot, which loses it, re-enrolls by a fresh quote of the same
launch (console/reenrollment.py). Runs once, before any worker starts.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from umbra.attest.enroll_client import BOOT_RETRY_DELAYS, EnrollError, ensure_credential
from umbra.attest.eventlog import Event
from umbra.proxy.config import ProxyConfig
from umbra.proxy.startup import StartupError, config_evidence, console_verify


def ensure_console_credential(config: ProxyConfig) -> bool:
    """Enroll when there is a token and no credential yet. Returns whether it enrolled now."""
    if config.enroll_token_file is None:
        return False
    assert config.console_url is not None and config.security_cvm_id is not None
    assert config.console_credential_file is not None  # ProxyConfig requires them together
    source, events = config_evidence(config, "enrollment evidence")

    def quoter(report_data: bytes) -> tuple[bytes, Sequence[Event] | None]:
        return source.get_quote(report_data), events() if events is not None else None

    try:
        _credential, enrolled = ensure_credential(
            console_url=config.console_url,
            cvm_id=config.security_cvm_id,
            token_file=config.enroll_token_file,
            credential_file=config.console_credential_file,
            quoter=quoter,
            verify=console_verify(config),
            # A reboot lost the credential (tmpfs): re-enroll by a fresh quote of this launch.
            launch_events=events() if events is not None else None,
            # At boot the Console may not answer yet (or ever): retried, then failed with why.
            retry_delays=BOOT_RETRY_DELAYS,
            say=lambda line: print(line, file=sys.stderr, flush=True),
        )
    except EnrollError as exc:
        raise StartupError(f"enrollment: {exc}") from None
    return enrolled
