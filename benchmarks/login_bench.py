"""What storing the Console login in the OS keyring costs the one-process ProxyCommand.

Per sample: a fresh `python` that imports `umbra.cli.ssh_proxy` and reads the stored login
(`fresh_login`), i.e. everything `umbra ssh-proxy` does before it talks to the Console. Two
configurations, interleaved so machine load hits both alike: the token in the 0600 file
(`UMBRA_NO_KEYRING=1`), and the token in a real gnome-keyring Secret Service on a private D-Bus
bus (read with `secretstorage` alone; `keyring` itself is never imported on this path).
The fast ProxyCommand (`ssh_fastproxy.py`, stdlib only) never reads the login: its warm agent
does, once per connection, in an already-started interpreter.

Run: .venv/bin/python benchmarks/login_bench.py [-n N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.session.secret_service import secret_service  # noqa: E402

PROBE = (
    "import sys, time; t = time.perf_counter(); import umbra.cli.ssh_proxy; "
    "from umbra.cli.credentials import fresh_login; fresh_login(); "
    "print(time.perf_counter() - t, 'keyring' in sys.modules)"
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-n", type=int, default=15)
    args = parser.parse_args()
    drop = {"UMBRA_NO_KEYRING", "DBUS_SESSION_BUS_ADDRESS"}
    base = {k: v for k, v in os.environ.items() if k not in drop}
    samples: dict[str, list[float]] = {"file": [], "keyring": []}
    with (
        tempfile.TemporaryDirectory(prefix=f"u10-bench-{os.getpid()}-") as tmp,
        secret_service(Path(tmp)) as bus,
    ):
        envs = {
            "file": {**base, "XDG_CONFIG_HOME": f"{tmp}/file", "UMBRA_NO_KEYRING": "1"},
            "keyring": {**base, **bus, "XDG_CONFIG_HOME": f"{tmp}/keyring"},
        }
        save = (
            "from umbra.cli.credentials import Login, save_login; "
            "print(save_login(Login(url='https://console.invalid', token='t0k')).describe())"
        )
        for env in envs.values():
            subprocess.run([sys.executable, "-c", save], env=env, check=True)
        for _ in range(args.n):
            for name, env in envs.items():
                start = time.perf_counter()
                done = subprocess.run(
                    [sys.executable, "-c", PROBE], env=env, check=True, capture_output=True
                )
                samples[name].append(time.perf_counter() - start)
                assert done.stdout.split()[1] == b"False", "keyring was imported"
    file_ms, ring_ms = (statistics.median(samples[k]) * 1000 for k in ("file", "keyring"))
    print(f"ProxyCommand start to token, median of {args.n} (load {os.getloadavg()[0]:.1f}):")
    print(f"  token in 0600 file     {file_ms:7.1f} ms")
    print(
        f"  token in OS keyring    {ring_ms:7.1f} ms  (+{ring_ms - file_ms:.1f} ms, "
        f"{ring_ms / file_ms:.2f}x)"
    )


if __name__ == "__main__":
    main()
