"""The emulated VM's network for a Dev workload (umbra.emulated.qemu): exactly the Console's and
the Security CVM's addresses relayed to loopback, the SSH ingress published on loopback, and
nothing else. Fast: the QEMU command line only (a boot is tests/images/test_emulated_walkthrough.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from umbra.components.ports import CONSOLE_PORT, DEV_ATTESTED_SSH_PORT, SECURITY_TUNNEL_PORT
from umbra.emulated import relay
from umbra.emulated.metadata import METADATA_ADDRESS, Shape
from umbra.emulated.qemu import GATEWAY, Forward, Published, VmConfig, VmError, netdev


def _config(tmp_path: Path, **kw: object) -> VmConfig:
    return VmConfig(
        Shape.gcp, tmp_path / "d", tmp_path / "e", tmp_path / "s", tmp_path / "q", 1001, 1002,
        python="/py", **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def test_exactly_the_console_and_security_cvm_and_the_ssh_port(tmp_path: Path) -> None:
    forwards = (
        Forward("168.0.1.10", CONSOLE_PORT, 4431),
        Forward("168.0.1.20", SECURITY_TUNNEL_PORT, 8441),
    )
    published = (Published(2201, DEV_ATTESTED_SSH_PORT),)
    parts = netdev(_config(tmp_path, forwards=forwards, published=published)).split(",")
    assert "restrict=on" in parts  # nothing else of the guest's leaves
    fwd = [p for p in parts if p.startswith("guestfwd=")]
    assert fwd == [
        f"guestfwd=tcp:{METADATA_ADDRESS}:80-cmd:/py -I -S {relay.__file__} 127.0.0.1 1001",
        f"guestfwd=tcp:168.0.1.10:443-cmd:/py -I -S {relay.__file__} 127.0.0.1 4431",
        f"guestfwd=tcp:168.0.1.20:8443-cmd:/py -I -S {relay.__file__} 127.0.0.1 8441",
    ]
    assert [p for p in parts if p.startswith("hostfwd=")] == [
        f"hostfwd=tcp:127.0.0.1:2201-:{DEV_ATTESTED_SSH_PORT}"
    ]
    # Without them: the metadata forward only, no published port.
    plain = netdev(_config(tmp_path)).split(",")
    assert sum(p.startswith("guestfwd=") for p in plain) == 1
    assert not any(p.startswith("hostfwd=") for p in plain)


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("10.0.0.5", "must be inside 168.0.0.0/6"),
        (GATEWAY, "not one of"),
        (METADATA_ADDRESS, "not one of"),
        ("console.test", "not an IPv4 address"),
    ],
)
def test_a_forward_outside_the_network_or_on_a_reserved_address_is_refused(
    tmp_path: Path, address: str, why: str
) -> None:
    with pytest.raises(VmError, match=why):
        netdev(_config(tmp_path, forwards=(Forward(address, 443, 4431),)))
