"""GCP Confidential VM with Intel TDX (C3): confidential_instance_type TDX, TERMINATE on host
maintenance (a TD cannot live-migrate), Shielded VM, launch data in instance metadata.

A launch-data change replaces the instance. Its name is fixed (and the Security CVM's address
too), so the old instance must go first: `delete_before_replace`, else GCP answers 409 to the
create. The developer's work lives on a separate persistent disk that is not replaced and is
re-attached to the new instance.
"""

from __future__ import annotations

import pulumi
import pulumi_gcp as gcp

from umbra.components.console_pool import gcp_static_address
from umbra.components.cvm import VmParts, VmSpec
from umbra.components.naming import labels as make_labels
from umbra.components.ports import ROLE_SECURITY, SECURITY_ROUTE_TAG

# No API access is wanted; GCP requires a scope list, so the narrowest one.
MINIMAL_SCOPES = ["https://www.googleapis.com/auth/userinfo.email"]
API_SCOPES = ["https://www.googleapis.com/auth/cloud-platform"]
DATA_DEVICE = "umbra-data"


def build_gcp_vm(name: str, spec: VmSpec, opts: pulumi.ResourceOptions) -> VmParts:
    args = spec.args
    place = args.placement
    developer = getattr(args, "developer", None) or None
    labels = {**args.labels, **make_labels(args.team, spec.role, developer=developer)}
    attached: list[gcp.compute.InstanceAttachedDiskArgs] = []
    if args.data_disk_gb:
        disk = gcp.compute.Disk(
            f"{name}-data",
            name=f"{args.vm_name}-data",
            project=place.project,
            zone=place.zone,
            size=args.data_disk_gb,
            type="pd-balanced",
            labels=labels,
            opts=opts,
        )
        attached.append(
            gcp.compute.InstanceAttachedDiskArgs(
                source=disk.self_link, device_name=DATA_DEVICE, mode="READ_WRITE"
            )
        )
    # Team CVMs have no access config (the Security CVM egresses through the team's Cloud NAT);
    # only the Console, which serves HTTPS to the internet, asks for an external address: a
    # reserved static one, its own resource, so a release that replaces the VM keeps it (team
    # stacks pin it as `console_ips`, and the policy pack as declared Console addresses).
    address: pulumi.Output[str] | None = None
    if spec.public_ip:
        address = gcp_static_address(
            name, args.vm_name, place.project, _region(place.zone), labels, opts
        )
    ni = gcp.compute.InstanceNetworkInterfaceArgs(
        subnetwork=args.subnet_id,
        network_ip=spec.private_ip,
        access_configs=[
            gcp.compute.InstanceNetworkInterfaceAccessConfigArgs(
                nat_ip=address, network_tier="PREMIUM"
            )
        ]
        if address is not None
        else None,
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
                image=args.image, size=args.disk_gb, type="pd-balanced", labels=labels
            ),
        ),
        attached_disks=attached,
        network_interfaces=[ni],
        can_ip_forward=False,
        service_account=gcp.compute.InstanceServiceAccountArgs(
            email=args.identity, scopes=API_SCOPES if args.api_access else MINIMAL_SCOPES
        ),
        metadata=spec.launch.apply(lambda d: d.gcp_metadata()),
        tags=[SECURITY_ROUTE_TAG] if spec.role == ROLE_SECURITY else [],
        labels=labels,
        desired_status="RUNNING" if args.running else "TERMINATED",
        # A machine-type change stops and starts the VM (same launch data, same disks).
        allow_stopping_for_update=True,
        # Measured configuration is launch-bound: a change is a new launch, not an edit. Fixed
        # names and addresses mean the old instance must be deleted before the new one exists.
        opts=pulumi.ResourceOptions.merge(
            opts,
            pulumi.ResourceOptions(replace_on_changes=["metadata"], delete_before_replace=True),
        ),
    )
    private_ip = vm.network_interfaces.apply(lambda nis: nis[0].network_ip or "")
    public_ip = address
    return VmParts(
        instance_id=vm.instance_id,
        private_ip=private_ip,
        public_ip=public_ip,
        self_link=vm.self_link,
    )


def _region(zone: str | None) -> str:
    """`us-central1-a` -> `us-central1`: a static external address is regional."""
    if not zone or zone.count("-") < 2:
        raise ValueError(f"GCP zone {zone!r} is not <region>-<letter>")
    return zone.rsplit("-", 1)[0]
