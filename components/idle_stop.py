"""Idle auto-stop for Dev CVMs: the guest powers itself off after `idle_minutes` with no running
agent session and no SSH connection. A GCP guest poweroff leaves the instance TERMINATED (billed
for disks only); on Azure a guest poweroff leaves the VM allocated, so the Console reconciles it
with `umbra cvm update --stop` (the provider removes the VM and keeps its disk and NIC).

Activity is what a developer leaves running, not only who is logged in:
- agent sessions: dtach sockets under the sessions directory whose master still accepts a
  connection (a dead session leaves a socket file that refuses);
- SSH: ESTABLISHED TCP connections on the forwarder's ingress port, read from the forwarder's
  network namespace (`/proc/<forwarder pid>/net/tcp`: the port is DNATed into its container).

Standard library only: the image installs this file on the host with the units from
`render_units` (a oneshot service run by a timer; state in one small file), run by the image's
own CPython (`PYTHON`: the OS image has no Debian python3).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ESTABLISHED = "01"


@dataclass(frozen=True)
class IdleConfig:
    sessions_dir: str = "/run/umbra/sessions"
    # Files in /proc/net/tcp format to read connections from (the forwarder's namespace).
    tcp_tables: Sequence[str] = field(default_factory=lambda: ("/proc/net/tcp", "/proc/net/tcp6"))
    ssh_port: int = 2222
    idle_minutes: int = 60
    state_file: str = "/var/lib/umbra/idle-since"

    def __post_init__(self) -> None:
        if self.idle_minutes < 5:
            raise ValueError("idle_minutes must be at least 5")


def live_sessions(sessions_dir: Path) -> int:
    """dtach masters that still answer on their socket."""
    if not sessions_dir.is_dir():
        return 0
    live = 0
    for path in sessions_dir.iterdir():
        try:
            if not stat.S_ISSOCK(path.lstat().st_mode):
                continue
        except OSError:
            continue
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(1.0)
            try:
                sock.connect(str(path))
            except OSError:
                continue  # a session that ended leaves its socket file behind
            live += 1
    return live


def established_on(port: int, tables: Iterable[Path]) -> int:
    """ESTABLISHED connections whose local port is `port`, from /proc/net/tcp-format tables."""
    count = 0
    for table in tables:
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) < 4 or parts[3] != ESTABLISHED:
                continue
            local_port = int(parts[1].rsplit(":", 1)[1], 16)
            if local_port == port:
                count += 1
    return count


def decide(
    now: float, active: bool, idle_since: float | None, idle_minutes: int
) -> tuple[bool, float | None]:
    """(stop now?, new idle-since): activity resets the clock; idleness starts it."""
    if active:
        return False, None
    since = now if idle_since is None else idle_since
    return now - since >= idle_minutes * 60, since


def check(cfg: IdleConfig, now: float | None = None) -> tuple[bool, dict[str, int]]:
    now = time.time() if now is None else now
    counts = {
        "sessions": live_sessions(Path(cfg.sessions_dir)),
        "ssh": established_on(cfg.ssh_port, [Path(t) for t in cfg.tcp_tables]),
    }
    state = Path(cfg.state_file)
    try:
        idle_since: float | None = float(state.read_text())
    except (OSError, ValueError):
        idle_since = None
    stop, since = decide(now, any(counts.values()), idle_since, cfg.idle_minutes)
    if since is None:
        state.unlink(missing_ok=True)
    else:
        state.parent.mkdir(parents=True, exist_ok=True)
        state.write_text(f"{since}\n")
    return stop, counts


# Where the image installs this file, and where the launch agent writes a Dev CVM's config (per
# boot, on tmpfs: the timer runs only where the agent started it, never on a Security CVM).
SCRIPT_PATH = "/usr/local/lib/umbra/idle_stop.py"
CONFIG_PATH = "/run/umbra/idle.json"
TIMER = "umbra-idle.timer"
# The interpreter the units run the script with: the OS image's CPython (images.recipes
# PYTHON_PREFIX, copied by images.build.copy_python); Debian's python3 is not installed.
PYTHON = "/opt/python/bin/python3"
DOCKER_VOLUMES = "/var/lib/docker/volumes"


def dev_cvm_config(project: str, ssh_port: int, idle_minutes: int = 60) -> IdleConfig:
    """A Dev CVM's activity, as the host sees it: the dtach sockets in the compose's `sessions`
    volume (docker-compose 1.29 names it `<project>_sessions`) and ESTABLISHED connections on the
    attested SSH ingress, a host process (the host's own /proc/net/tcp tables)."""
    return IdleConfig(
        sessions_dir=f"{DOCKER_VOLUMES}/{project}_sessions/_data",
        tcp_tables=("/proc/net/tcp", "/proc/net/tcp6"),
        ssh_port=ssh_port,
        idle_minutes=idle_minutes,
        state_file="/var/lib/umbra/idle-since",
    )


def install_files(root: Path) -> list[Path]:
    """What an OS image build puts into its rootfs `root`: this script (stdlib only, run by the
    image's CPython, `PYTHON`) and the two units, **not enabled** (the launch agent starts the
    timer on a Dev CVM only). Returns the paths written."""
    written = []
    script = root / SCRIPT_PATH.lstrip("/")
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_bytes(Path(__file__).read_bytes())
    script.chmod(0o644)
    written.append(script)
    units = root / "etc/systemd/system"
    units.mkdir(parents=True, exist_ok=True)
    for name, text in render_units().items():
        (units / name).write_text(text)
        (units / name).chmod(0o644)
        written.append(units / name)
    return written


def render_units(
    config_path: str = CONFIG_PATH, script: str = SCRIPT_PATH, python: str = PYTHON
) -> dict[str, str]:
    """systemd units the image installs: a oneshot check every five minutes."""
    return {
        "umbra-idle.service": (
            "[Unit]\nDescription=Umbra Dev CVM idle auto-stop check\n\n"
            "[Service]\nType=oneshot\n"
            f"ExecStart={python} {script} --config {config_path}\n"
        ),
        "umbra-idle.timer": (
            "[Unit]\nDescription=Umbra Dev CVM idle auto-stop\n\n"
            "[Timer]\nOnBootSec=15min\nOnUnitActiveSec=5min\n\n"
            "[Install]\nWantedBy=timers.target\n"
        ),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--config", required=True)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    try:
        cfg = IdleConfig(**json.loads(Path(args.config).read_text()))
    except (OSError, ValueError, TypeError) as exc:
        print(f"idle-stop: {args.config}: {exc}", file=sys.stderr)
        return 2
    stop, counts = check(cfg)
    print(json.dumps({"stop": stop, **counts}))
    if stop and not args.dry_run:
        os.sync()
        subprocess.run(["systemctl", "poweroff"], check=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
