"""Ports and labels the infrastructure and the policy pack agree on."""

from typing import Final

from umbra.sandbox.models import ATTESTED_SSH_PORT

# The Security CVM's tunnel endpoint: the only place a Dev CVM's forwarder may dial.
SECURITY_TUNNEL_PORT: Final = 8443
# The Dev CVM's attested SSH ingress (a host process, docs/specs/session.md). Port 22 is never
# opened.
DEV_ATTESTED_SSH_PORT: Final = ATTESTED_SSH_PORT
# The Console's HTTPS port: a Dev CVM's forwarder enrolls there once (components.host_firewall).
CONSOLE_PORT: Final = 443
# What the Security CVM's proxy may dial on the internet.
SECURITY_EGRESS_PORTS: Final = (80, 443)

ROLE_LABEL: Final = "umbra-role"
TEAM_LABEL: Final = "umbra-team"
DEVELOPER_LABEL: Final = "umbra-developer"
COST_CENTRE_LABEL: Final = "umbra-cost-centre"
ROLE_DEV: Final = "dev-cvm"
ROLE_SECURITY: Final = "security-cvm"
ROLE_CONSOLE: Final = "console"
# GCP network tag for the Security CVM: routes can only select instances by tag.
SECURITY_ROUTE_TAG: Final = "umbra-security-cvm"

# The name a Dev CVM's forwarder dials (images/definitions, measured in its compose file); each
# team network answers it from a private zone with its own Security CVM's fixed address.
PRIVATE_ZONE: Final = "umbra.internal"
SECURITY_CVM_HOST: Final = f"security-cvm.{PRIVATE_ZONE}"

# The Dev CVM's runc topology (sandbox/dev_definition.py, index 1 of sandbox/local_cvm.py's
# scheme): the forwarder's uplink /30 (its namespace ↔ the host; the host firewall forwards and
# masquerades it to the Security CVM and the Console only) and the sandbox's /30 (sandbox ↔
# forwarder, never routed through the host). Must equal the measured host definition's.
DEV_UPLINK_CIDR: Final = "10.232.1.0/30"
DEV_INTERNAL_CIDRS: Final = ("10.231.1.0/30",)
# Cloud metadata / platform DNS addresses a guest reaches whatever the VPC firewall says.
METADATA_ADDRESSES: Final = ("169.254.169.254", "168.63.129.16")
# Where the launch agent (root) reports the VM ready, over HTTP port 80, per cloud: GCP's
# metadata server (guest attribute `umbra/ready`), Azure's wire server (the goal state's health
# report; with the VM agent off, a VM that never reports Ready fails its provisioning).
READY_REPORT_ADDRESSES: Final = {"gcp": "169.254.169.254", "azure": "168.63.129.16"}
READY_REPORT_PORT: Final = 80
