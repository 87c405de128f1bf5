"""The Umbra Pulumi program: `pulumi up -s <team-stack>` builds one team (see docs/specs/infra.md).
All logic lives in umbra.components; this file only tells it where the project root is."""

from pathlib import Path

from umbra.components.program import run

run(Path(__file__).resolve().parent.parent)
