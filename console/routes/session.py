"""The developer's session path: what `umbra ssh-proxy` needs to attest and reach a Dev CVM."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, status

from umbra.attest.session_info import SessionInfo
from umbra.console.deps import ConsoleDep, UserDep
from umbra.console.enums import CvmKind
from umbra.console.routes.common import CvmIdPath
from umbra.console.services.access import visible_cvm
from umbra.console.session_info import session_info

router = APIRouter(prefix="/api/v1", tags=["session"])


@router.get(
    "/cvms/{cvm_id}/session",
    summary="A Dev CVM's SSH ingress, release manifest and launch-bound keys (admin or owner).",
)
def get_session(cvm_id: CvmIdPath, console: ConsoleDep, user: UserDep) -> SessionInfo:
    with console.session() as session:
        cvm = visible_cvm(session, user, cvm_id)
        if cvm.kind != CvmKind.dev:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, f"{cvm_id} is not a Dev CVM")
        return session_info(cvm)
