"""Path parameters shared by route modules (what a route does lives in `console/services/`)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Path

from umbra.console.schemas import CVM_ID_PATTERN, NAME_PATTERN

TeamPath = Annotated[str, Path(pattern=NAME_PATTERN, description="Team name.")]
CvmIdPath = Annotated[str, Path(pattern=CVM_ID_PATTERN, description="CVM id.")]
