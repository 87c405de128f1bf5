"""`python -m umbra.cli.up_pccs`: `umbra up --runtime qemu`'s PCCS, serving the stack's simulated
PKI collateral (attest.simpccs: the v4 API dcap-qvl's client calls) on a loopback port. The
Security CVM's tunnel endpoint fetches its own collateral here and sends it with its quote
(`--tunnel-collateral-pccs`): what a Dev CVM's forwarder in a VM, which reaches no PCCS, verifies
the Security CVM against (`collateral: {relayed: true}`). Re-dated at every start."""

from __future__ import annotations

import argparse
import contextlib
import threading
import time
from pathlib import Path

from umbra.attest.simpccs import SimulatedPccs
from umbra.attest.simpki import SimulatedPki


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="umbra.cli.up_pccs")
    parser.add_argument("--pki", required=True, type=Path)
    parser.add_argument("--port", required=True, type=int)
    args = parser.parse_args(argv)
    pki = SimulatedPki.load(args.pki)
    with (
        contextlib.suppress(KeyboardInterrupt),
        SimulatedPccs(pki, int(time.time()) - 3600, port=args.port),
    ):
        threading.Event().wait()


if __name__ == "__main__":
    main()
