"""The one strict pydantic base: unknown fields are errors and instances are immutable. Every
document Umbra parses (configs, manifests, wire bodies) derives from it, so "strict" means one
thing everywhere; a model that needs more (the Console's no-control-characters rule, the policy
model's strict types) adds it in a subclass."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
