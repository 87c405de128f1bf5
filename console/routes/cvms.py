"""CVMs: launch, list, update and destroy through provider adapters; attach profiles. Adapters
over `services/cvms.py`."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query, status

from umbra.console.deps import ConsoleDep, UserDep
from umbra.console.routes.common import CvmIdPath, TeamPath
from umbra.console.schemas import CvmCreate, CvmCreated, CvmInfo, CvmUpdate, ProfilesUpdate
from umbra.console.services import cvms
from umbra.console.services.cvms import cvm_info

router = APIRouter(prefix="/api/v1", tags=["cvms"])


@router.post(
    "/teams/{team}/cvms",
    status_code=status.HTTP_201_CREATED,
    summary="Launch a CVM (admin: any; developer: own Dev CVMs).",
)
def create_cvm(team: TeamPath, body: CvmCreate, console: ConsoleDep, user: UserDep) -> CvmInfo:
    return cvms.launch(console=console, user=user, team=team, request=body)


@router.get("/teams/{team}/cvms", summary="List CVMs (admin: all of the team; developer: own).")
def list_cvms(
    team: TeamPath,
    console: ConsoleDep,
    user: UserDep,
    include_destroyed: Annotated[bool, Query()] = False,
) -> list[CvmInfo]:
    rows = cvms.list_cvms(
        console=console, user=user, team=team, include_destroyed=include_destroyed
    )
    return [cvm_info(row) for row in rows]


@router.get("/cvms/{cvm_id}", summary="One CVM (admin of its team, or its owner).")
def get_cvm(cvm_id: CvmIdPath, console: ConsoleDep, user: UserDep) -> CvmInfo:
    return cvm_info(cvms.get(console=console, user=user, cvm_id=cvm_id))


@router.patch("/cvms/{cvm_id}", summary="Start/stop, re-route, or change SSH keys/size.")
def update_cvm(cvm_id: CvmIdPath, body: CvmUpdate, console: ConsoleDep, user: UserDep) -> CvmInfo:
    return cvms.update(console=console, user=user, cvm_id=cvm_id, change=body)


@router.delete("/cvms/{cvm_id}", summary="Destroy a CVM (admin, or the owner of a Dev CVM).")
def destroy_cvm(cvm_id: CvmIdPath, console: ConsoleDep, user: UserDep) -> CvmInfo:
    return cvms.destroy(console=console, user=user, cvm_id=cvm_id)


@router.put(
    "/cvms/{cvm_id}/profiles",
    summary="Attach policy profiles to a Dev CVM (admin; its owner: agent logins only).",
)
def attach_profiles(
    cvm_id: CvmIdPath,
    body: ProfilesUpdate,
    console: ConsoleDep,
    user: UserDep,
    if_match: Annotated[
        str | None,
        Header(
            alias="If-Match",
            max_length=128,
            description="Attach only if the attachments are still this version (else 412).",
        ),
    ] = None,
) -> CvmInfo:
    return cvms.attach_profiles(
        console=console, user=user, cvm_id=cvm_id, profiles=body.profiles, if_match=if_match
    )


@router.post(
    "/cvms/{cvm_id}/credential",
    summary="Issue a new credential for a Security CVM, revoking the old one (admin).",
)
def rotate_credential(cvm_id: CvmIdPath, console: ConsoleDep, user: UserDep) -> CvmCreated:
    return cvms.rotate_credential(console=console, user=user, cvm_id=cvm_id)
