"""One naming function per kind of cloud VM, and the labels every resource carries.

A Dev CVM has exactly one owner: the team stack (declared under `developers[].cvms`) or the
Console (launched per developer through the provisioner). Both build names here, and the owner is
part of the name, so the two can never produce the same cloud name: `umbra-acme-alice-main-s…`
(team stack) and `umbra-acme-alice-main-c…` (Console) differ, and the digest over the unsplit
parts also keeps `team a-b, developer c` apart from `team a, developer b-c`.
"""

from __future__ import annotations

import hashlib
import re
from enum import StrEnum

from umbra.components.ports import COST_CENTRE_LABEL, DEVELOPER_LABEL, ROLE_LABEL, TEAM_LABEL

# GCP instance names: [a-z]([-a-z0-9]*[a-z0-9])?, at most 63; Azure Linux VM names: at most 64.
MAX_VM_NAME = 63
_DIGEST = 8
_LABEL_VALUE = re.compile(r"^[a-z0-9_-]{0,63}$")


class Owner(StrEnum):
    TEAM_STACK = "s"
    CONSOLE = "c"


def dev_cvm_name(team: str, developer: str, cvm: str, owner: Owner) -> str:
    """The cloud name of one Dev CVM (instance, VM and the prefix of its disks and NIC)."""
    digest = hashlib.sha256(f"{owner.value}\0{team}\0{developer}\0{cvm}".encode()).hexdigest()
    suffix = f"-{owner.value}{digest[:_DIGEST]}"
    readable = f"umbra-{team}-{developer}-{cvm}"[: MAX_VM_NAME - len(suffix)].rstrip("-")
    return readable + suffix


def security_cvm_name(team: str, replica: int = 0) -> str:
    """The team stack owns its Security CVMs; replica 0 keeps the historical name."""
    return f"umbra-{team}-sec" if replica == 0 else f"umbra-{team}-sec-{replica}"


def labels(
    team: str, role: str, *, developer: str | None = None, cost_centre: str | None = None
) -> dict[str, str]:
    """Team, role, developer and cost centre on every resource that takes labels or tags."""
    out = {TEAM_LABEL: team, ROLE_LABEL: role}
    if developer:
        out[DEVELOPER_LABEL] = developer
    if cost_centre:
        out[COST_CENTRE_LABEL] = cost_centre
    for key, value in out.items():
        if not _LABEL_VALUE.match(value):
            raise ValueError(f"label {key}={value!r}: GCP label values are [a-z0-9_-], at most 63")
    return out
