"""The emulated clouds' quote relay for the Security CVM's proxy (`--tee emulated` only).

On TDX the proxy container binds configfs-tsm and quotes there. On an emulated-cloud VM the TEE
is the host's simulated TDX module behind a root-only virtio-serial port (attest.tdx_port), which
no container may open (it also extends RTMR3). So the launch agent starts, before the compose, a
root service that serves **quotes only** on a unix socket in the Security CVM's launch directory
(the compose binds that directory read-only; the socket is 0600, owned by the proxy's uid) and
asks the module over the port: `umbra image tdx-quote-relay`, a transient systemd unit
(`umbra-tdx-quote`), gone at shutdown like everything the boot measured.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

UNIT = "umbra-tdx-quote"
UMBRA = "/opt/python/bin/umbra"


class QuoteRelayError(Exception):
    pass


@dataclass(frozen=True)
class SystemdQuoteRelay:
    uid: int
    # The relay is the umbra CLI: its start under TCG on a loaded host takes a while.
    wait: float = 300.0
    umbra: str = UMBRA

    def start(self, socket: Path) -> None:
        cmd = ["systemd-run", f"--unit={UNIT}", "--collect", "--quiet",
               self.umbra, "image", "tdx-quote-relay", "--socket", str(socket),
               "--uid", str(self.uid)]  # fmt: skip
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise QuoteRelayError(f"systemd-run {UNIT}: {exc}") from None
        if done.returncode != 0:
            raise QuoteRelayError(f"systemd-run {UNIT}: {done.stderr.strip()}")
        deadline = time.monotonic() + self.wait
        while not socket.is_socket():  # the proxy's first quote must find it
            if time.monotonic() > deadline:
                raise QuoteRelayError(f"{UNIT}: {socket} did not appear in {self.wait:.0f} s")
            time.sleep(0.2)
