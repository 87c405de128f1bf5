"""The inline Pulumi program: one Dev CVM on the team network the team stack exports, from the
request itself (launch, update, destroy) or from the stack's own config (stop/start)."""

from __future__ import annotations

from typing import Any

import pulumi

from umbra.components.automation.spec import DevCvmSpec, TeamTarget
from umbra.components.cvm import DevCvm, DevCvmArgs, Placement
from umbra.components.naming import Owner, dev_cvm_name

# The stack config keys the program reads: the whole request, and whether the VM runs.
DEV_CVM_KEY = "umbra:devCvm"
RUNNING_KEY = "umbra:running"


def build_dev_cvm(target: TeamTarget, spec: DevCvmSpec, *, running: bool = True) -> DevCvm:
    """The inline program body: one Dev CVM on the team network the team stack exports."""
    team = pulumi.StackReference(target.team_stack)
    if target.gcp is not None:
        place = Placement(cloud="gcp", project=target.gcp.project, zone=target.gcp.zone)
        identity: pulumi.Output[Any] | None = team.require_output("dev_identity")
    else:
        assert target.azure is not None
        place = Placement(
            cloud="azure",
            location=target.azure.location,
            zone=target.azure.zone,
            resource_group_name=team.require_output("resource_group_name"),
        )
        identity = None
    cvm = DevCvm(
        f"{target.team}-{spec.developer}-{spec.cvm}",
        DevCvmArgs(
            team=target.team,
            vm_name=dev_cvm_name(target.team, spec.developer, spec.cvm, Owner.CONSOLE),
            placement=place,
            size=spec.size,
            image=spec.image,
            disk_gb=spec.disk_gb,
            subnet_id=team.require_output("dev_subnet_id"),
            identity=identity,
            app_compose=spec.app_compose,
            cvm_id=spec.cvm_id or "",
            measurement_manifest=spec.measurement_manifest,
            developer=spec.developer,
            ssh_authorized_keys=spec.ssh_authorized_keys,
            security_cvm_ips=team.require_output("security_cvm_ip").apply(lambda ip: [ip]),
            # The forwarder enrolls there once (the token below); a team stack from before
            # these outputs gives none, and the CVM's enrollment then fails with the reason.
            console_url=team.get_output("console_url").apply(lambda url: str(url or "")),
            console_ca=team.get_output("console_ca_pem").apply(lambda pem: str(pem or "")),
            console_ips=team.get_output("console_ips").apply(lambda ips: list(ips or [])),
            data_disk_gb=spec.data_disk_gb,
            running=running,
            enrollment_token=spec.enrollment_token,
        ),
    )
    pulumi.export("instance_id", cvm.instance_id)
    pulumi.export("private_ip", cvm.private_ip)
    pulumi.export("compose_sha256", cvm.compose_sha256)
    pulumi.export("ssh_keys_sha256", cvm.ssh_keys_sha256)
    pulumi.export("expected_events", cvm.expected_events)
    return cvm


def config_program() -> None:
    """The same program, with the request read from the stack's own config (stop/start)."""
    config = pulumi.Config("umbra")
    doc = config.require_object(DEV_CVM_KEY.split(":")[1])
    target, spec = TeamTarget.from_doc(doc["target"]), DevCvmSpec(**doc["spec"])
    build_dev_cvm(target, spec, running=config.get_bool("running") is not False)
