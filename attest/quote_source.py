"""Where quotes come from: the kernel's configfs-tsm interface, or the simulator.

configfs-tsm ABI (Linux ≥ 6.7): mkdir an entry under /sys/kernel/config/tsm/report, write the
64-byte report data to `inblob`, read the quote from `outblob`; `generation` counts writes so a
reader can tell whether another writer raced it. The entry is removed afterwards.
"""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from umbra.attest.errors import AttestError, QuoteSourceError

if TYPE_CHECKING:  # the simulator loads dcap_qvl; models naming QuoteSourceKind must not
    from umbra.attest.simulator import SimulatedTdx

DEFAULT_TSM_REPORT = Path("/sys/kernel/config/tsm/report")


class QuoteSourceKind(StrEnum):
    """Where a CVM service's quotes come from: the TD's configfs-tsm; the emulated clouds' host
    TDX module (attest.tdx_port); the in-process simulator (embedded mode). The last two chain
    to the simulated root only."""

    configfs = "configfs"
    emulated = "emulated"
    simulated = "simulated"


class QuoteSource(Protocol):
    simulated: bool

    def get_quote(self, report_data: bytes) -> bytes: ...


class ConfigfsTsmSource:
    simulated = False

    def __init__(self, root: str | Path = DEFAULT_TSM_REPORT) -> None:
        self.root = Path(root)
        self._lock = threading.Lock()

    def get_quote(self, report_data: bytes) -> bytes:
        if len(report_data) != 64:
            raise QuoteSourceError(f"report_data must be 64 bytes, got {len(report_data)}")
        entry = self.root / f"umbra-{uuid.uuid4().hex}"
        with self._lock:
            try:
                self._create_entry(entry)
            except OSError as exc:
                raise QuoteSourceError(
                    f"cannot create {entry} ({exc.strerror}); is this a TDX guest with configfs-tsm?"
                ) from None
            try:
                before = self._generation(entry)
                (entry / "inblob").write_bytes(report_data)
                quote = (entry / "outblob").read_bytes()
                after = self._generation(entry)
                if before is not None and after is not None and after != before + 1:
                    raise QuoteSourceError("configfs-tsm entry was written concurrently; retry")
                provider = entry / "provider"
                if provider.is_file() and provider.read_text().strip() not in ("tdx_guest", ""):
                    raise QuoteSourceError(
                        f"configfs-tsm provider is {provider.read_text().strip()!r}, not tdx_guest"
                    )
            except OSError as exc:
                raise QuoteSourceError(f"configfs-tsm I/O failed on {entry}: {exc}") from None
            finally:
                # The kernel drops an entry's attribute files with it; a fake tree may keep it.
                with contextlib.suppress(OSError):
                    os.rmdir(entry)
        if not quote:
            raise QuoteSourceError("configfs-tsm returned an empty quote")
        return quote

    def _create_entry(self, entry: Path) -> None:
        entry.mkdir()

    @staticmethod
    def _generation(entry: Path) -> int | None:
        path = entry / "generation"
        if not path.is_file():
            return None
        try:
            return int(path.read_text().strip())
        except ValueError:
            raise QuoteSourceError(f"{path} is not an integer") from None


class SimulatedSource:
    simulated = True

    def __init__(self, tdx: SimulatedTdx) -> None:
        self.tdx = tdx

    def get_quote(self, report_data: bytes) -> bytes:
        if len(report_data) != 64:
            raise QuoteSourceError(f"report_data must be 64 bytes, got {len(report_data)}")
        try:
            return self.tdx.quote(report_data)
        except AttestError as exc:
            raise QuoteSourceError(str(exc)) from None
