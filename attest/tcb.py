"""Our platform (TCB) policy, enforced on top of dcap-qvl's cryptographic verification."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import Field, field_validator, model_validator

from umbra.contracts.model import Strict

THIRTY_DAYS = 30 * 24 * 3600


class TcbStatus(StrEnum):
    UP_TO_DATE = "UpToDate"
    SW_HARDENING_NEEDED = "SWHardeningNeeded"
    CONFIGURATION_NEEDED = "ConfigurationNeeded"
    CONFIGURATION_AND_SW_HARDENING_NEEDED = "ConfigurationAndSWHardeningNeeded"
    OUT_OF_DATE = "OutOfDate"
    OUT_OF_DATE_CONFIGURATION_NEEDED = "OutOfDateConfigurationNeeded"
    REVOKED = "Revoked"


OUT_OF_DATE_STATUSES = frozenset(
    {TcbStatus.OUT_OF_DATE, TcbStatus.OUT_OF_DATE_CONFIGURATION_NEEDED}
)


def _hex64(v: object) -> int:
    if isinstance(v, int):
        return v
    if isinstance(v, str):
        return int(v.removeprefix("0x"), 16)
    raise ValueError("expected an integer or a hex string")


Hex64 = Annotated[int, Field(ge=0, lt=1 << 64)]


class MaskedValue(Strict):
    """`(actual & mask) == value`: bits outside the mask are free, bits inside are pinned."""

    value: Hex64
    mask: Hex64

    @field_validator("value", "mask", mode="before")
    @classmethod
    def _parse(cls, v: object) -> int:
        return _hex64(v)

    @model_validator(mode="after")
    def _value_within_mask(self) -> MaskedValue:
        if self.value & ~self.mask:
            raise ValueError("value sets bits outside mask; such a rule could never match")
        return self

    def matches(self, actual: int) -> bool:
        return actual & self.mask == self.value


class TcbPolicy(Strict):
    """Which platforms we accept. Defaults are the strict ones."""

    allowed_statuses: list[TcbStatus] = Field(default_factory=lambda: [TcbStatus.UP_TO_DATE])
    allowed_advisories: list[str] = Field(default_factory=list)
    # OutOfDate(ConfigurationNeeded) is accepted only while tcbDate(level) + grace >= now,
    # dcap-qvl's definition; 0 means never, even when listed in allowed_statuses.
    out_of_date_grace_seconds: int = Field(default=0, ge=0)
    max_collateral_age_seconds: int = Field(default=THIRTY_DAYS, gt=0)
    min_tcb_eval_data_number: int | None = Field(default=None, ge=0)
    # Cloud TDX hosts report these PCK flags as True; refusing them would refuse every cloud.
    allow_dynamic_platform: bool = True
    allow_cached_keys: bool = True
    allow_smt: bool = True

    @field_validator("allowed_statuses")
    @classmethod
    def _no_revoked(cls, v: list[TcbStatus]) -> list[TcbStatus]:
        if TcbStatus.REVOKED in v:
            raise ValueError("Revoked can never be allowed")
        if not v:
            raise ValueError("at least one TCB status must be allowed")
        return v

    @model_validator(mode="after")
    def _grace_needs_out_of_date(self) -> TcbPolicy:
        if self.out_of_date_grace_seconds and not OUT_OF_DATE_STATUSES & set(self.allowed_statuses):
            raise ValueError("out_of_date_grace_seconds is set but OutOfDate is not allowed")
        return self


class TdPolicy(Strict):
    """TD attributes and XFAM under value/mask. The DEBUG bit is refused regardless."""

    attributes: MaskedValue = MaskedValue(value=0, mask=1)
    xfam: MaskedValue = MaskedValue(value=0, mask=0)
