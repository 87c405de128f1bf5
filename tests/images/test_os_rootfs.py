"""What the OS image build writes into its rootfs besides Debian's packages and the Python tree
(images.os_image.configure_rootfs), checked on a scratch directory for every definition: fast, no
mmdebstrap. The boot tests run the same function inside a real build."""

from __future__ import annotations

from pathlib import Path

import pytest

from umbra.components.idle_stop import CONFIG_PATH, PYTHON, SCRIPT_PATH, TIMER
from umbra.images.os_image import (
    DISABLED_UNITS,
    OS_DIR,
    configure_rootfs,
    load_os_definition,
)
from umbra.images.recipes import PYTHON_PREFIX

DEFINITIONS = sorted(p.name for p in OS_DIR.glob("*.yaml"))


@pytest.mark.parametrize("name", DEFINITIONS)
def test_every_os_image_gets_idle_stop_installed_not_enabled(name: str, tmp_path: Path) -> None:
    """Before, nothing called install_files: the launch agent's `systemctl start umbra-idle.timer`
    found no unit on any image, and idle stop never ran."""
    configure_rootfs(load_os_definition(OS_DIR / name), tmp_path)
    script = tmp_path / SCRIPT_PATH.lstrip("/")
    assert script.is_file() and b"import umbra" not in script.read_bytes()  # stdlib only
    units = tmp_path / "etc/systemd/system"
    assert (units / TIMER).is_file()
    service = (units / "umbra-idle.service").read_text()
    # The image's own CPython (copy_python keeps `python3`): Debian's python3 is not installed.
    assert f"{PYTHON_PREFIX}/bin/python3" == PYTHON
    assert f"ExecStart={PYTHON} {SCRIPT_PATH} --config {CONFIG_PATH}" in service
    # Installed, not enabled: only the launch agent starts the timer, on a Dev CVM.
    enabled = [p.name for p in units.rglob("*.wants/*")]
    assert "umbra-idle.timer" not in enabled and "umbra-idle.service" not in enabled
    assert "umbra-launch-agent.service" in enabled


@pytest.mark.parametrize("name", DEFINITIONS)
def test_docker_is_not_started_at_boot(name: str, tmp_path: Path) -> None:
    """Debian's docker.io and containerd enable their units; on a Dev CVM the host dockerd's
    FORWARD-drop ruleset cut the forwarder's egress (the emulated GCP's enrollment timed out).
    The build disables them and the agent's unit no longer pulls Docker in: the agent starts it
    for a compose role only (test_launch_agent.py)."""
    units = tmp_path / "etc/systemd/system"
    for link in DISABLED_UNITS:  # as the packages' postinst leave them
        (units / link).parent.mkdir(parents=True, exist_ok=True)
        (units / link).symlink_to(f"/usr/lib/systemd/system/{Path(link).name}")
    configure_rootfs(load_os_definition(OS_DIR / name), tmp_path)
    enabled = {p.name for p in units.rglob("*.wants/*")}
    assert not enabled & {"docker.service", "docker.socket", "containerd.service"}, enabled
    agent = (units / "umbra-launch-agent.service").read_text()
    assert "docker" not in "".join(
        line for line in agent.splitlines() if line.startswith(("Wants=", "After=", "Requires="))
    )
