"""What the OS image build writes into its rootfs besides Debian's packages and the Python tree
(images.os_image.configure_rootfs), checked on a scratch directory for every definition: fast, no
mmdebstrap. The boot tests run the same function inside a real build."""

from __future__ import annotations

from pathlib import Path

import pytest

from umbra.components.idle_stop import CONFIG_PATH, PYTHON, SCRIPT_PATH, TIMER
from umbra.images.os_image import OS_DIR, configure_rootfs, load_os_definition
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
