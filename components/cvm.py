"""SecurityCvm and DevCvm: TDX confidential VMs whose launch-bound configuration (compose file,
SSH keys, measurement manifest reference) is delivered as instance metadata / user data and
measured by the guest. Any change to that configuration replaces the VM: it is a new launch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pulumi

from umbra.components.launch_data import LaunchData
from umbra.components.network import Cloud
from umbra.components.ports import ROLE_DEV, ROLE_SECURITY


@dataclass(frozen=True)
class Placement:
    cloud: Cloud
    # GCP: project and zone. Azure: location, optional zone and the team's resource group.
    project: str | None = None
    zone: str | None = None
    location: str | None = None
    resource_group_name: pulumi.Input[str] | None = None


@dataclass(frozen=True)
class CvmArgs:
    """What every CVM needs. `app_compose` is the release's app-compose.json (`umbra image
    measure --out`): canonical JSON around umbra.sandbox's rendered docker-compose, whose SHA-256
    is the compose hash. `measurement_manifest` is the release manifest's URL or digest."""

    team: str
    vm_name: str
    placement: Placement
    size: str
    image: str
    subnet_id: pulumi.Input[str]
    app_compose: pulumi.Input[str]
    measurement_manifest: pulumi.Input[str] | None = None
    # The `umbra.cvm-id` event payload (the Console's CVM id); defaults to vm_name.
    cvm_id: str = ""
    disk_gb: int = 50
    # GCP: the service account the network's firewall rules target.
    identity: pulumi.Input[str] | None = None
    labels: dict[str, str] = field(default_factory=dict)
    # GCP: the VM calls Google APIs (the Console's provisioner): scope cloud-platform, with the
    # service account's roles as the limit. Team CVMs call none and keep the narrowest scope.
    api_access: bool = False
    # A persistent disk separate from the boot disk (0: none). It is its own resource, so it
    # survives the VM's replacement on a launch-data change and image updates.
    data_disk_gb: int = 0
    # False stops the VM (GCP: TERMINATED; Azure: the VM is removed, its disk and NIC stay).
    running: bool = True
    # The Console's one-time enrollment token for this CVM's launch data (a Pulumi secret).
    enrollment_token: str | None = field(default=None, repr=False)


# The Security CVM's data disk: its proxy's spool of unshipped traffic records (a reboot keeps it).
SECURITY_DATA_DISK_GB = 20


@dataclass(frozen=True)
class SecurityCvmArgs(CvmArgs):
    # The fixed address Dev CVM egress rules name (TeamNetwork.security_cvm_ip).
    private_ip: pulumi.Input[str] = ""
    # Public resolvers the proxy uses: the team network's own DNS answers nothing public.
    dns_resolvers: Sequence[str] = ()
    # Replicas: the load balancer's address, which the guest adds as a local route (an internal
    # passthrough LB delivers packets addressed to it).
    lb_ip: str = ""
    # Azure replicas: the internal load balancer's backend pool the replica's NIC joins.
    lb_backend_pool: pulumi.Input[str] | None = None
    # The Console the proxy reports to (from config or the Console stack) and its TLS CA.
    console_url: pulumi.Input[str] | None = None
    console_ca: pulumi.Input[str] | None = None
    data_disk_gb: int = SECURITY_DATA_DISK_GB


@dataclass(frozen=True)
class DevCvmArgs(CvmArgs):
    developer: str = ""
    # Launch-bound: their hash is the `umbra.ssh-authorized-keys` RTMR3 event.
    ssh_authorized_keys: Sequence[str] = ()
    # The team's Security CVM address(es): the host firewall and /etc/hosts name them, so the
    # Dev CVM needs no DNS at all.
    security_cvm_ips: pulumi.Input[Sequence[str]] = ()
    # The Console the forwarder enrolls at (once, at first start, with the launch data's one-time
    # token), its TLS CA and its address(es): the Dev CVM has no DNS, and its host firewall
    # admits exactly these addresses on 443 from the forwarder's uplink.
    console_url: pulumi.Input[str] | None = None
    console_ca: pulumi.Input[str] | None = None
    console_ips: pulumi.Input[Sequence[str]] = ()
    data_disk_gb: int = 100

    def __post_init__(self) -> None:
        if not self.developer:
            raise ValueError("DevCvmArgs.developer is required")
        if not self.ssh_authorized_keys:
            raise ValueError(f"DevCvmArgs: developer {self.developer!r} has no SSH keys")


@dataclass(frozen=True)
class VmSpec:
    """The cloud-neutral description a builder turns into resources."""

    role: str
    args: CvmArgs
    launch: pulumi.Output[LaunchData]
    private_ip: pulumi.Input[str] | None
    public_ip: bool
    ssh_keys: Sequence[str]


@dataclass
class VmParts:
    instance_id: pulumi.Output[str]
    private_ip: pulumi.Output[str]
    public_ip: pulumi.Output[str] | None = None
    # GCP: the instance's self link (load-balancer instance groups name instances by it).
    self_link: pulumi.Output[str] | None = None
    # Azure, api_access: the VM's system-assigned identity (the principal roles are granted to).
    principal_id: pulumi.Output[str] | None = None


def _launch_data(
    role: str,
    args: CvmArgs,
    keys: Sequence[str],
    security_ips: pulumi.Input[Sequence[str]] = (),
    dns_resolvers: Sequence[str] = (),
    lb_ip: str = "",
    console: tuple[pulumi.Input[str] | None, pulumi.Input[str] | None] = (None, None),
    console_ips: pulumi.Input[Sequence[str]] = (),
) -> pulumi.Output[LaunchData]:
    manifest = args.measurement_manifest
    inputs: list[pulumi.Input[Any]] = [
        args.app_compose,
        manifest,
        security_ips,
        *console,
        console_ips,
    ]
    if args.enrollment_token:
        # Secret: the token is encrypted in the stack's state, and so is the metadata it joins.
        inputs.append(pulumi.Output.secret(args.enrollment_token))
    return pulumi.Output.all(*inputs).apply(
        lambda v: LaunchData(
            role=role,
            team=args.team,
            cvm_id=args.cvm_id or args.vm_name,
            instance_name=args.vm_name,
            app_compose=v[0],
            measurement_manifest=v[1],
            ssh_authorized_keys=tuple(keys),
            security_cvm_ips=tuple(v[2] or ()),
            dns_resolvers=tuple(dns_resolvers),
            lb_ip=lb_ip or None,
            console_url=v[3] or None,
            console_ca=v[4] or None,
            console_ips=tuple(v[5] or ()),
            enrollment_token=v[6] if len(v) > 6 else None,
            cloud=args.placement.cloud,
        )
    )


def _build(name: str, spec: VmSpec, opts: pulumi.ResourceOptions) -> VmParts:
    if spec.args.placement.cloud == "gcp":
        from umbra.components.gcp_vm import build_gcp_vm

        return build_gcp_vm(name, spec, opts)
    from umbra.components.azure_vm import build_azure_vm

    return build_azure_vm(name, spec, opts)


class _Cvm(pulumi.ComponentResource):
    instance_id: pulumi.Output[str]
    private_ip: pulumi.Output[str]
    compose_sha256: pulumi.Output[str]
    expected_events: pulumi.Output[dict[str, str]]
    is_placeholder: pulumi.Output[bool]
    self_link: pulumi.Output[str] | None

    def _finish(self, spec: VmSpec, parts: VmParts, extra: dict[str, Any]) -> None:
        self.instance_id = parts.instance_id
        self.self_link = parts.self_link
        self.private_ip = parts.private_ip
        self.compose_sha256 = spec.launch.apply(lambda d: d.compose_sha256)
        self.expected_events = spec.launch.apply(lambda d: d.expected_events())
        self.is_placeholder = spec.launch.apply(lambda d: d.is_placeholder)
        self.register_outputs(
            {
                "instance_id": self.instance_id,
                "private_ip": self.private_ip,
                "compose_sha256": self.compose_sha256,
                "expected_events": self.expected_events,
                "is_placeholder": self.is_placeholder,
                **extra,
            }
        )


class SecurityCvm(_Cvm):
    public_ip: pulumi.Output[str] | None

    def __init__(
        self, name: str, args: SecurityCvmArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("umbra:infra:SecurityCvm", name, None, opts)
        # The proxy dials the internet through the team's NAT (one static egress address); the
        # VM has no public address and its firewall admits only the tunnel from Dev CVMs.
        spec = VmSpec(
            role=ROLE_SECURITY,
            args=args,
            launch=_launch_data(
                ROLE_SECURITY,
                args,
                (),
                dns_resolvers=args.dns_resolvers,
                lb_ip=args.lb_ip,
                console=(args.console_url, args.console_ca),
            ),
            private_ip=args.private_ip or None,
            public_ip=False,
            ssh_keys=(),
        )
        parts = _build(name, spec, pulumi.ResourceOptions(parent=self))
        self.public_ip = parts.public_ip
        self._finish(spec, parts, {})


class DevCvm(_Cvm):
    ssh_keys_sha256: pulumi.Output[str]

    def __init__(
        self, name: str, args: DevCvmArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("umbra:infra:DevCvm", name, None, opts)
        keys = tuple(args.ssh_authorized_keys)
        spec = VmSpec(
            role=ROLE_DEV,
            args=args,
            launch=_launch_data(
                ROLE_DEV,
                args,
                keys,
                args.security_cvm_ips,
                console=(args.console_url, args.console_ca),
                console_ips=args.console_ips,
            ),
            private_ip=None,
            public_ip=False,
            ssh_keys=keys,
        )
        parts = _build(name, spec, pulumi.ResourceOptions(parent=self))
        self.ssh_keys_sha256 = spec.launch.apply(lambda d: d.ssh_keys_sha256 or "")
        self._finish(
            spec, parts, {"ssh_keys_sha256": self.ssh_keys_sha256, "developer": args.developer}
        )
