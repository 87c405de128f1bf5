"""Enrollment's wire contract, shared by the Console and the CVMs that enroll (proxy, forwarder).

A booted CVM trades the one-time token its launch data carries, plus a quote binding a key it
generated inside the TEE, for its long-lived credential, HPKE-sealed to that key
(docs/specs/embedded.md, "Enrollment"). The client side lives in `attest/enroll_client.py`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from umbra.contracts.canonical import canonical_json

# Launch-data key (GCP metadata / Azure custom data) of the one-time token; the image's launch
# agent writes its value to LAUNCH_TOKEN_PATH, root-only, for the enrolling process.
META_ENROLLMENT_TOKEN = "umbra-enrollment-token"  # noqa: S105 -- a key name, not a token
LAUNCH_TOKEN_PATH = "/run/umbra/launch/enrollment-token"  # noqa: S105 -- a path
TOKEN_PREFIX = "enr_"  # noqa: S105 -- a prefix, not a token
# Long-lived credentials: a Security CVM's Console bearer, a Dev CVM's tunnel credential.
SECURITY_CVM_CREDENTIAL_PREFIX = "umbra_scvm_"
TUNNEL_CREDENTIAL_PREFIX = "umbra_tun_"

# A team stack's Security CVM replica i: its Console CVM id is `umbra:stack.security_cvm.cvm_ids[i]`
# and its one-time token the Pulumi secret config key below (`umbra cvm security-replica I`
# prints both; components/config.py reads them).
SECURITY_REPLICA_TOKEN_KEY = "umbra:securityEnrollmentToken{replica}"  # noqa: S105 -- a key name


def security_token_key(replica: int) -> str:
    return SECURITY_REPLICA_TOKEN_KEY.format(replica=replica)


# A team stack's Dev CVM `developers[d].cvms[c]`: its Console CVM id is
# `developers[d].cvm_ids[c]` and its one-time token this Pulumi secret config key.
DEV_CVM_TOKEN_KEY = "umbra:devEnrollmentToken-{developer}-{cvm}"  # noqa: S105 -- a key name


def dev_token_key(developer: str, cvm: str) -> str:
    return DEV_CVM_TOKEN_KEY.format(developer=developer, cvm=cvm)


REPORT_DATA_CONTEXT = b"umbra-enroll-v1\x00"
HPKE_INFO_CONTEXT = b"umbra-enroll-credential-v1"


def report_data(nonce: str, cvm_id: str, public_key: bytes) -> bytes:
    """What the enrolling TD puts in its quote (distinct from secret release's binding)."""
    return hashlib.sha512(
        REPORT_DATA_CONTEXT + nonce.encode() + b"\x00" + cvm_id.encode() + b"\x00" + public_key
    ).digest()


def hpke_info(cvm_id: str, nonce: str) -> bytes:
    return HPKE_INFO_CONTEXT + b"\x00" + cvm_id.encode() + b"\x00" + nonce.encode()


# ---- re-enrollment by fresh quote ---------------------------------------------------------------
# A CVM that enrolled once and lost its credential (a reboot, a stop/start, an Azure re-create:
# its state lives on tmpfs) asks for a fresh one with a new quote, no token and no operator
# (docs/specs/embedded.md, "Re-enrollment"). What ties the quote to the CVM is its measured launch:
# the launch-bound RTMR3 events below, replayed from the event log against the quote, must equal
# those the CVM's first enrollment showed (the CVM id among them). Per-boot events (boot id, SSH
# host key) are not launch-bound and change on every boot.
RENEW_REPORT_DATA_CONTEXT = b"umbra-renew-v1\x00"
RENEW_HPKE_INFO_CONTEXT = b"umbra-renew-credential-v1"
LAUNCH_BOUND_EVENTS = (
    "compose-hash",
    "umbra.cvm-id",
    "umbra.ssh-authorized-keys",
    "umbra.host-firewall",
)


def launch_binding_sha256(binding: Mapping[str, str]) -> str:
    """A digest of the binding (canonical JSON), the renewal challenge's routing hint."""
    return hashlib.sha256(canonical_json(dict(binding))).hexdigest()


def renew_report_data(nonce: str, cvm_id: str, public_key: bytes) -> bytes:
    """What a renewing TD puts in its quote: distinct from enrollment's and secret release's."""
    return hashlib.sha512(
        RENEW_REPORT_DATA_CONTEXT
        + nonce.encode()
        + b"\x00"
        + cvm_id.encode()
        + b"\x00"
        + public_key
    ).digest()


def renew_hpke_info(cvm_id: str, nonce: str) -> bytes:
    return RENEW_HPKE_INFO_CONTEXT + b"\x00" + cvm_id.encode() + b"\x00" + nonce.encode()
