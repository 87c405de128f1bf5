"""GCP Confidential VM with Intel TDX (C3): confidential_instance_type TDX, TERMINATE on host
maintenance (a TD cannot live-migrate), Shielded VM, launch data in instance metadata."""

from __future__ import annotations

from collections.abc import Sequence

import pulumi
import pulumi_gcp as gcp

from umbra.components.cvm import VmParts, VmSpec
from umbra.components.ports import ROLE_LABEL, ROLE_SECURITY, SECURITY_ROUTE_TAG, TEAM_LABEL

# No API access is wanted; GCP requires a scope list, so the narrowest one.
MINIMAL_SCOPES = ["https://www.googleapis.com/auth/userinfo.email"]


def build_gcp_vm(name: str, spec: VmSpec, opts: pulumi.ResourceOptions) -> VmParts:
    args = spec.args
    place = args.placement
    ni = gcp.compute.InstanceNetworkInterfaceArgs(
        subnetwork=args.subnet_id,
        network_ip=spec.private_ip,
        # An empty access config asks for an ephemeral external address; Dev CVMs get none.
        access_configs=[gcp.compute.InstanceNetworkInterfaceAccessConfigArgs()]
        if spec.public_ip
        else [],
    )
    vm = gcp.compute.Instance(
        name,
        name=args.vm_name,
        project=place.project,
        zone=place.zone,
        machine_type=args.size,
        confidential_instance_config=gcp.compute.InstanceConfidentialInstanceConfigArgs(
            confidential_instance_type="TDX",
        ),
        scheduling=gcp.compute.InstanceSchedulingArgs(
            on_host_maintenance="TERMINATE",
            automatic_restart=True,
            provisioning_model="STANDARD",
        ),
        shielded_instance_config=gcp.compute.InstanceShieldedInstanceConfigArgs(
            enable_secure_boot=True,
            enable_vtpm=True,
            enable_integrity_monitoring=True,
        ),
        boot_disk=gcp.compute.InstanceBootDiskArgs(
            auto_delete=True,
            initialize_params=gcp.compute.InstanceBootDiskInitializeParamsArgs(
                image=args.image, size=args.disk_gb, type="pd-balanced"
            ),
        ),
        network_interfaces=[ni],
        can_ip_forward=False,
        service_account=gcp.compute.InstanceServiceAccountArgs(
            email=args.identity, scopes=MINIMAL_SCOPES
        ),
        metadata=spec.launch.apply(lambda d: d.gcp_metadata()),
        tags=[SECURITY_ROUTE_TAG] if spec.role == ROLE_SECURITY else [],
        labels={**args.labels, ROLE_LABEL: spec.role, TEAM_LABEL: args.team},
        allow_stopping_for_update=False,
        # Measured configuration is launch-bound: a change is a new launch, not an edit.
        opts=pulumi.ResourceOptions.merge(
            opts, pulumi.ResourceOptions(replace_on_changes=["metadata"])
        ),
    )
    private_ip = vm.network_interfaces.apply(lambda nis: nis[0].network_ip or "")
    public_ip = vm.network_interfaces.apply(_nat_ip) if spec.public_ip else None
    return VmParts(instance_id=vm.instance_id, private_ip=private_ip, public_ip=public_ip)


def _nat_ip(nis: Sequence[gcp.compute.outputs.InstanceNetworkInterface]) -> str:
    configs = nis[0].access_configs or []
    return (configs[0].nat_ip or "") if configs else ""
