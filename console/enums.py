"""The Console's closed vocabularies, defined once: CVM kind and state, secret scope, role, audit
action. The tables, API schemas, services, provisioning and the CLI all use these; each value is
the string stored in the database and sent on the wire, so no migration or API change follows.
(Traffic decisions and kinds are wire contracts: `umbra.contracts.traffic`.)
"""

from __future__ import annotations

from enum import StrEnum

# ruff: noqa: S105  (audit action names such as "secret.set", not passwords)


class CvmKind(StrEnum):
    dev = "dev"
    security = "security"


class CvmState(StrEnum):
    """launching/updating/destroying: a cloud provider is working outside any transaction; a
    failed run ends in `failed` with `state_reason` (destroy it to clean up what it left)."""

    pending = "pending"
    launching = "launching"
    updating = "updating"
    destroying = "destroying"
    running = "running"
    stopped = "stopped"
    failed = "failed"
    destroyed = "destroyed"


class Power(StrEnum):
    """What a person may ask a CVM to be (`PATCH /cvms/{id}` `state`)."""

    running = "running"
    stopped = "stopped"


class Operation(StrEnum):
    """A provider run (`provisioning`); a cloud stop/start shows as `updating` until it settles."""

    launch = "launch"
    update = "update"
    destroy = "destroy"
    start = "start"
    stop = "stop"


class Scope(StrEnum):
    team = "team"
    personal = "personal"


class Role(StrEnum):
    admin = "admin"
    developer = "developer"


class AuditAction(StrEnum):
    cvm_launch = "cvm.launch"
    cvm_update = "cvm.update"
    cvm_destroy = "cvm.destroy"
    cvm_credential = "cvm.credential"
    cvm_enroll = "cvm.enroll"
    cvm_enroll_refused = "cvm.enroll_refused"
    cvm_enroll_refused_summary = "cvm.enroll_refused_summary"
    cvm_reenroll = "cvm.reenroll"
    cvm_reenroll_refused = "cvm.reenroll_refused"
    cvm_enrollment_token = "cvm.enrollment_token"
    cvm_provisioned = "cvm.provisioned"
    cvm_quota_refused = "cvm.quota_refused"
    cvm_resumed = "cvm.resumed"
    cvm_register_replica = "cvm.register_replica"
    policy_upload = "policy.upload"
    profiles_attach = "profiles.attach"
    profiles_defaults = "profiles.defaults"
    team_quotas = "team.quotas"
    secret_set = "secret.set"
    secret_delete = "secret.delete"
    secret_release = "secret.release"
    secret_refresh = "secret.refresh"  # a Security CVM wrote back a rotated refresh token
    secret_refresh_failed = "secret.refresh_failed"  # the token endpoint refused: needs a login
    user_deactivate = "user.deactivate"
    user_reactivate = "user.reactivate"
    traffic_retention = "traffic.retention"  # a retention run (console/traffic_retention.py)


class SecretStatus(StrEnum):
    """Whether the Security CVMs can use a secret as stored; `needs_login` after a token endpoint
    refused its refresh token (set it again, e.g. `umbra codex connect`)."""

    ok = "ok"
    needs_login = "needs_login"
