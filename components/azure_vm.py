"""Azure confidential VM on TDX (DCesv5/ECesv5): security type ConfidentialVM, UEFI secure boot and
vTPM, OS disk encrypted with the VM guest state (keys bound to the vTPM), launch data in the VM's
user data (`userData`: IMDS serves it to the guest; it answers custom data with an empty body). Under Azure's paravisor the guest measures this into the vTPM, not RTMR3: see
docs/specs/infra.md.

User data can be edited on a running VM, but launch data is measured at boot: a change is a new
launch, so it replaces the VM (`replace_on_changes` on it), deleting the old one first (its name, NIC and address are fixed).
The developer's work is on a separate managed data disk that is only detached and re-attached.
Stopping removes the VM and keeps its disk and NIC: Azure bills a deallocated VM's disks only,
and the same launch data relaunches it.
"""

from __future__ import annotations

import pulumi
import pulumi_azure_native as azure
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from umbra.components.cvm import VmParts, VmSpec
from umbra.components.naming import labels as make_labels

ADMIN_USER = "umbra"
USER_DATA_PATH = "userData"


def image_reference(image: str) -> azure.compute.ImageReferenceArgs:
    """A resource id (gallery or managed image) or a marketplace URN publisher:offer:sku:version."""
    if image.startswith("/"):
        return azure.compute.ImageReferenceArgs(id=image)
    parts = image.split(":")
    if len(parts) != 4 or not all(parts):
        raise ValueError(
            f"Azure image {image!r} is neither a resource id nor publisher:offer:sku:version"
        )
    publisher, offer, sku, version = parts
    return azure.compute.ImageReferenceArgs(
        publisher=publisher, offer=offer, sku=sku, version=version
    )


def _unusable_key() -> str:
    """Azure insists on an SSH key for Linux; the Security CVM has no login, so it gets a fresh
    public key whose private half is never kept."""
    pub = Ed25519PrivateKey.generate().public_key()
    raw = pub.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return raw.decode()


def build_azure_vm(name: str, spec: VmSpec, opts: pulumi.ResourceOptions) -> VmParts:
    args = spec.args
    place = args.placement
    developer = getattr(args, "developer", None) or None
    tags = {**args.labels, **make_labels(args.team, spec.role, developer=developer)}
    zones = [place.zone] if place.zone else None
    # Security CVM replicas on Azure: the internal load balancer's pool this NIC joins.
    pool = getattr(args, "lb_backend_pool", None)
    # Only the Console serves the internet; team CVMs egress through the team's NAT Gateway.
    public_ip = None
    if spec.public_ip:
        public_ip = azure.network.PublicIPAddress(
            f"{name}-pip",
            public_ip_address_name=f"{args.vm_name}-pip",
            resource_group_name=place.resource_group_name,
            location=place.location,
            sku=azure.network.PublicIPAddressSkuArgs(name="Standard"),
            public_ip_allocation_method="Static",
            zones=zones,
            tags=tags,
            opts=opts,
        )
    nic = azure.network.NetworkInterface(
        f"{name}-nic",
        network_interface_name=f"{args.vm_name}-nic",
        resource_group_name=place.resource_group_name,
        location=place.location,
        enable_ip_forwarding=False,
        ip_configurations=[
            azure.network.NetworkInterfaceIPConfigurationArgs(
                name="primary",
                primary=True,
                subnet=azure.network.SubnetArgs(id=args.subnet_id),
                private_ip_allocation_method="Static" if spec.private_ip else "Dynamic",
                private_ip_address=spec.private_ip,
                public_ip_address=azure.network.PublicIPAddressArgs(id=public_ip.id)
                if public_ip
                else None,
                load_balancer_backend_address_pools=[azure.network.BackendAddressPoolArgs(id=pool)]
                if pool is not None
                else None,
            )
        ],
        tags=tags,
        opts=opts,
    )
    data_disks: list[azure.compute.DataDiskArgs] = []
    if args.data_disk_gb:
        disk = azure.compute.Disk(
            f"{name}-data",
            disk_name=f"{args.vm_name}-data",
            resource_group_name=place.resource_group_name,
            location=place.location,
            zones=zones,
            sku=azure.compute.DiskSkuArgs(name="Premium_LRS"),
            creation_data=azure.compute.CreationDataArgs(create_option="Empty"),
            disk_size_gb=args.data_disk_gb,
            tags=tags,
            opts=opts,
        )
        data_disks.append(
            azure.compute.DataDiskArgs(
                lun=0,
                create_option="Attach",
                delete_option="Detach",
                managed_disk=azure.compute.ManagedDiskParametersArgs(id=disk.id),
            )
        )
    private_ip = nic.ip_configurations.apply(
        lambda cfgs: (cfgs[0].private_ip_address or "") if cfgs else ""
    )
    if not args.running:
        return VmParts(instance_id=pulumi.Output.from_input(""), private_ip=private_ip)
    keys = list(spec.ssh_keys) or [_unusable_key()]
    vm = azure.compute.VirtualMachine(
        name,
        vm_name=args.vm_name,
        resource_group_name=place.resource_group_name,
        location=place.location,
        zones=zones,
        hardware_profile=azure.compute.HardwareProfileArgs(vm_size=args.size),
        security_profile=azure.compute.SecurityProfileArgs(
            security_type="ConfidentialVM",
            uefi_settings=azure.compute.UefiSettingsArgs(
                secure_boot_enabled=True, v_tpm_enabled=True
            ),
        ),
        storage_profile=azure.compute.StorageProfileArgs(
            image_reference=image_reference(args.image),
            os_disk=azure.compute.OSDiskArgs(
                create_option="FromImage",
                delete_option="Delete",
                disk_size_gb=args.disk_gb,
                managed_disk=azure.compute.ManagedDiskParametersArgs(
                    storage_account_type="Premium_LRS",
                    security_profile=azure.compute.VMDiskSecurityProfileArgs(
                        security_encryption_type="DiskWithVMGuestState",
                    ),
                ),
            ),
            data_disks=data_disks,
        ),
        os_profile=azure.compute.OSProfileArgs(
            computer_name=args.vm_name,
            admin_username=ADMIN_USER,
            allow_extension_operations=False,
            linux_configuration=azure.compute.LinuxConfigurationArgs(
                disable_password_authentication=True,
                provision_vm_agent=False,
                ssh=azure.compute.SshConfigurationArgs(
                    public_keys=[
                        azure.compute.SshPublicKeyArgs(
                            key_data=k, path=f"/home/{ADMIN_USER}/.ssh/authorized_keys"
                        )
                        for k in keys
                    ]
                ),
            ),
        ),
        # Only the Console's VM calls Azure APIs (its provisioner): a system-assigned identity.
        identity=azure.compute.VirtualMachineIdentityArgs(
            type=azure.compute.ResourceIdentityType.SYSTEM_ASSIGNED
        )
        if args.api_access
        else None,
        user_data=spec.launch.apply(lambda d: d.azure_user_data()),
        network_profile=azure.compute.NetworkProfileArgs(
            network_interfaces=[
                azure.compute.NetworkInterfaceReferenceArgs(id=nic.id, primary=True)
            ]
        ),
        tags=tags,
        opts=pulumi.ResourceOptions.merge(
            opts,
            pulumi.ResourceOptions(
                # Launch data is measured at boot: a change is a new launch, never an edit.
                replace_on_changes=[USER_DATA_PATH],
                delete_before_replace=True,
                # The throwaway key is new on every run; only the measured user data counts.
                ignore_changes=[] if spec.ssh_keys else ["osProfile.linuxConfiguration.ssh"],
            ),
        ),
    )
    return VmParts(
        instance_id=vm.vm_id,
        private_ip=private_ip,
        public_ip=public_ip.ip_address.apply(lambda a: a or "") if public_ip else None,
        principal_id=vm.identity.apply(lambda i: (i.principal_id or "") if i else "")
        if args.api_access
        else None,
    )
