"""The sandbox image's recipe, cache key and failure messages; the runtime's OCI config and its
missing-runtime message (no root, no build: the runtime test builds and runs the real one)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from umbra.sandbox import image, local_cvm, runtime


def test_a_missing_debian_package_is_named() -> None:
    out = (
        "E: Failed to fetch http://deb.debian.org/debian/pool/main/s/strace/strace_6.13+ds-1_amd64.deb"
        "  Could not connect to deb.debian.org:80 (203.0.113.80), connection timed out\n"
        "E: Unable to fetch some archives\n"
    )
    msg = image.explain_failure("mmdebstrap", out)
    assert msg.startswith("mmdebstrap: the Debian package strace could not be downloaded")
    assert "connection timed out" in msg
    msg = image.explain_failure("mmdebstrap", "E: Unable to locate package no-such-pkg\n")
    assert msg == "mmdebstrap: the Debian package no-such-pkg is not in trixie"


def test_a_missing_npm_package_is_named() -> None:
    out = "npm error code ETARGET\nnpm error notarget No matching version found for @openai/codex@9.9.9.\n"
    assert "@openai/codex@9.9.9" in image.explain_failure("npm install", out)


def test_the_cache_key_follows_the_recipe(monkeypatch: pytest.MonkeyPatch) -> None:
    key = image.recipe_key()
    assert len(key) == 16 and key == image.recipe_key()
    monkeypatch.setattr(image, "PACKAGES", (*image.PACKAGES, "jq"))
    assert image.recipe_key() != key


def test_a_missing_build_tool_or_runtime_is_one_line_naming_the_package(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(image.ImageError, match=r"needs mmdebstrap: apt-get install mmdebstrap"):
        image.require_host_tools()
    with pytest.raises(
        runtime.RuntimeError_, match=r"^the sandbox runtime is missing: apt-get install runc"
    ):
        runtime.require_runtime()


def test_the_oci_config_maps_root_away_and_makes_its_own_network_namespace(tmp_path: Path) -> None:
    plan = local_cvm.LocalCvmPlan("cvm_abcdef123456", 7, "ut", str(tmp_path), 200000 + 7 * 65536)
    spec = local_cvm.sandbox_spec(plan, layers=(tmp_path / "files", tmp_path / "base"))
    config = runtime.oci_config(spec)
    linux = config["linux"]
    assert linux["uidMappings"] == [{"containerID": 0, "hostID": plan.uid, "size": 65536}]
    assert linux["gidMappings"] == linux["uidMappings"]
    # A network namespace of its own (runc's, owned by the sandbox's user namespace: nested
    # Docker makes its bridge there), never a joined one; sysfs is that namespace's own.
    assert {"type": "network"} in linux["namespaces"]
    assert {"destination": "/sys", "type": "sysfs", "source": "sysfs"}.items() <= next(
        m for m in config["mounts"] if m["destination"] == "/sys"
    ).items()
    assert {n["type"] for n in linux["namespaces"]} >= {"user", "mount", "pid", "cgroup"}
    assert "seccomp" not in linux and "maskedPaths" not in linux
    assert config["process"]["args"][:3] == [
        "/usr/bin/tini",
        "--",
        "/usr/local/bin/umbra-sandbox-init",
    ]
    assert f"UMBRA_LOCAL_CVM={plan.cvm_id}" in config["process"]["env"]
    # The rendered per-CVM values: the proxy and the resolver are the forwarder's address.
    env = local_cvm.sandbox_env(plan)
    assert f"HTTPS_PROXY=http://{plan.forwarder_addr}:3128\n" in env
    assert f"no_proxy={local_cvm.NO_PROXY}\n" in env
    for var in image.CA_VARS:
        assert f"{var}={image.CA_BUNDLE}\n" in env
    assert local_cvm.resolv_conf(plan).startswith(f"nameserver {plan.forwarder_addr}\n")


def test_a_joined_network_namespace_gets_the_hosts_sysfs_read_only(tmp_path: Path) -> None:
    """`SandboxSpec.netns` naming a host-owned namespace: joined by path, and sysfs (which the
    sandbox's user namespace cannot mount for it) is the host's, bound read-only."""
    plan = local_cvm.LocalCvmPlan("cvm_abcdef123456", 7, "ut", str(tmp_path), 200000 + 7 * 65536)
    spec = dataclasses.replace(
        local_cvm.sandbox_spec(plan, layers=(tmp_path / "base",)), netns=Path("/run/netns/x")
    )
    config = runtime.oci_config(spec)
    assert {"type": "network", "path": "/run/netns/x"} in config["linux"]["namespaces"]
    sys_mount = next(m for m in config["mounts"] if m["destination"] == "/sys")
    assert sys_mount["source"] == "/sys" and "ro" in sys_mount["options"]
