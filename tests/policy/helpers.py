"""Small builders for policy tests."""

from __future__ import annotations

from typing import Any

from umbra.policy.compiled import CompiledProfile, compile_profile
from umbra.policy.compose import EffectivePolicy
from umbra.policy.model import Profile


def profile(
    name: str, egress: list[dict[str, Any]] | None = None, **sections: Any
) -> CompiledProfile:
    document = {
        "apiVersion": "umbra/v1",
        "kind": "Profile",
        "name": name,
        "egress": egress or [],
        **sections,
    }
    compiled, _ = compile_profile(Profile.model_validate(document))
    return compiled


def policy(*profiles: CompiledProfile) -> EffectivePolicy:
    return EffectivePolicy(list(profiles))
