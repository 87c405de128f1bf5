"""Enrollment's wire contract, shared by the Console and the CVMs that enroll (proxy, forwarder).

A booted CVM trades the one-time token its launch data carries, plus a quote binding a key it
generated inside the TEE, for its long-lived credential, HPKE-sealed to that key
(docs/specs/embedded.md, "Enrollment"). The client side lives in `attest/enroll_client.py`.
"""

from __future__ import annotations

import hashlib

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


REPORT_DATA_CONTEXT = b"umbra-enroll-v1\x00"
HPKE_INFO_CONTEXT = b"umbra-enroll-credential-v1"


def report_data(nonce: str, cvm_id: str, public_key: bytes) -> bytes:
    """What the enrolling TD puts in its quote (distinct from secret release's binding)."""
    return hashlib.sha512(
        REPORT_DATA_CONTEXT + nonce.encode() + b"\x00" + cvm_id.encode() + b"\x00" + public_key
    ).digest()


def hpke_info(cvm_id: str, nonce: str) -> bytes:
    return HPKE_INFO_CONTEXT + b"\x00" + cvm_id.encode() + b"\x00" + nonce.encode()
