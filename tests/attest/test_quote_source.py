"""Quote sources: configfs-tsm (against an emulated kernel ABI) and the simulator."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from umbra.attest.errors import QuoteSourceError
from umbra.attest.quote import parse_quote
from umbra.attest.quote_source import ConfigfsTsmSource, SimulatedSource
from umbra.attest.simulator import SimulatedTdx


class EmulatedTsm(ConfigfsTsmSource):
    """Emulates the kernel side: outblob is a FIFO whose writer reads inblob first, so the
    quote exists only after report data was written, as with the real attribute."""

    def __init__(self, root: Path, tdx: SimulatedTdx) -> None:
        super().__init__(root)
        self.tdx = tdx
        self.seen: list[bytes] = []

    def _create_entry(self, entry: Path) -> None:
        super()._create_entry(entry)
        (entry / "generation").write_text("0\n")
        (entry / "provider").write_text("tdx_guest\n")
        os.mkfifo(entry / "outblob")

        def kernel() -> None:
            with open(entry / "outblob", "wb") as out:  # blocks until the reader opens
                rd = (entry / "inblob").read_bytes()
                self.seen.append(rd)
                (entry / "generation").write_text("1\n")
                out.write(self.tdx.quote(rd))

        threading.Thread(target=kernel, daemon=True).start()


def test_configfs_tsm_abi(tmp_path: Path, tdx: SimulatedTdx) -> None:
    src = EmulatedTsm(tmp_path, tdx)
    rd = bytes(range(64))
    quote = src.get_quote(rd)
    assert src.seen == [rd]
    assert parse_quote(quote).td_report.report_data == rd
    assert not src.simulated


def test_configfs_tsm_errors(tmp_path: Path) -> None:
    src = ConfigfsTsmSource(tmp_path / "missing")
    with pytest.raises(QuoteSourceError, match="configfs-tsm"):
        src.get_quote(bytes(64))
    with pytest.raises(QuoteSourceError, match="64 bytes"):
        src.get_quote(b"short")


def test_simulated_source(tdx: SimulatedTdx) -> None:
    src = SimulatedSource(tdx)
    assert src.simulated
    assert parse_quote(src.get_quote(b"\x01" * 64)).td_report.report_data == b"\x01" * 64
    with pytest.raises(QuoteSourceError):
        src.get_quote(b"\x01" * 65)
