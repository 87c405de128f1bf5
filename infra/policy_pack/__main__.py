"""Umbra policy pack: `pulumi preview --policy-pack infra/policy_pack` refuses any plan with a
non-TDX VM, a Dev CVM with a way around its Security CVM, or an SSH port open to the internet."""

from pulumi_policy import EnforcementLevel, PolicyPack
from umbra_policy_rules import policies

PolicyPack(
    name="umbra",
    enforcement_level=EnforcementLevel.MANDATORY,
    policies=policies(),
)
