"""Docker-level configuration the CVMs rely on (the Security CVM's compose runs on Debian's
docker.io). The Dev CVM's sandbox is on no Docker network at all (docs/specs/sandbox.md)."""

from __future__ import annotations

import pytest

from umbra.images.measure import measure
from umbra.images.os_image import OS_DIR, load_os_definition
from umbra.sandbox.validate import ComposeError, validate_security_compose

from ..sandbox.fixtures import security_definition

pytestmark = pytest.mark.timeout(1500)


def test_cve_2024_29018_path_stays_closed_by_configuration() -> None:
    """Docker < 26 (CI's Debian docker.io is 20.10) may forward DNS for containers on internal
    networks from the host's namespace when the upstream resolver is on loopback
    (CVE-2024-29018). The CVM never has such an upstream: compose `dns` is refused by the
    validator, the OS images carry no local resolver, the launch agent refuses loopback
    resolvers (tests/images/test_launch_host.py). The Dev CVM's sandbox is not a container at
    all: its resolver is the forwarder's (tests/images/test_dev_host.py)."""
    with pytest.raises(ComposeError, match="custom DNS servers are not allowed"):
        validate_security_compose(_with_dns(measure(security_definition()).compose.text))
    for name in ("gcp.yaml", "azure.yaml", "qemu.yaml"):
        packages = set(load_os_definition(OS_DIR / name).packages)
        assert not packages & {"systemd-resolved", "dnsmasq", "unbound", "bind9"}, name


def _with_dns(compose: str) -> str:
    return compose.replace(
        "    restart: unless-stopped\n", "    restart: unless-stopped\n    dns: [127.0.0.1]\n", 1
    )
