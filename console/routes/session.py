"""The developer's session path: what `umbra ssh-proxy` needs to attest and reach a Dev CVM."""

from __future__ import annotations

from fastapi import APIRouter

from umbra.attest.session_info import SessionInfo
from umbra.console.deps import ConsoleDep, UserDep
from umbra.console.routes.common import CvmIdPath
from umbra.console.services import cvms

router = APIRouter(prefix="/api/v1", tags=["session"])


@router.get(
    "/cvms/{cvm_id}/session",
    summary="A Dev CVM's SSH ingress, release manifest and launch-bound keys (admin or owner).",
)
def get_session(cvm_id: CvmIdPath, console: ConsoleDep, user: UserDep) -> SessionInfo:
    return cvms.ssh_session(console=console, user=user, cvm_id=cvm_id)
