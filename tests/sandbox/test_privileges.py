"""sandbox/privileges.py: the drop is for good (a child process as root drops, then tries to
get root back); uid 0 is refused."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from umbra.sandbox.privileges import PrivilegeError, drop_to

CHILD = """
import os
from umbra.sandbox.privileges import drop_to, effective_caps
os.setgroups([0, 4])
drop_to(150123)
assert os.getresuid() == (150123,) * 3 and os.getresgid() == (150123,) * 3
assert os.getgroups() == [] and effective_caps() == 0
for step in (lambda: os.setuid(0), lambda: os.setgroups([0]), lambda: open("/etc/shadow")):
    try:
        step()
    except PermissionError:
        continue
    raise SystemExit("regained a privilege")
print(open("/proc/self/status").read().split("NoNewPrivs:")[1].split()[0])
"""


def test_the_drop_is_for_good() -> None:
    if os.geteuid() != 0:
        pytest.skip("dropping root needs root (CI runs as root)")
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"


def test_root_or_a_negative_id_is_refused() -> None:
    for uid in (0, -1):
        with pytest.raises(PrivilegeError, match="not an unprivileged id"):
            drop_to(uid)
