"""The local provider's failure path: a CVM that cannot be provisioned is refused with its
reason, leaves nothing behind, and never touches what is not its own."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from umbra.console.providers import CvmSpec, ProviderError
from umbra.console.providers_local import LocalCvmProvider, LocalCvmSettings


def test_a_launch_that_cannot_be_provisioned_fails_with_its_reason(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("nft") is None:
        pytest.skip("needs root, iproute2 and nftables (CI has them)")
    prefix = f"uuv{os.getpid() % 100000}"
    identities = tmp_path / "identities.json"
    identities.write_text(json.dumps({"cvms": []}))
    provider = LocalCvmProvider(
        LocalCvmSettings(
            runtime_dir=tmp_path, name_prefix=prefix, security_cvm_port=9,
            security_cvm_release={}, collateral_file=tmp_path / "c.json",
            simulated_root=tmp_path / "root.der", identities_file=identities,
        )
    )  # fmt: skip
    spec = CvmSpec(id="cvm_00aa11bb22cc33dd", team="t", name="d", kind="dev", owner="o")
    squatter = f"{prefix}-00aa11bb-sbx"  # someone else's namespace with the name we would use
    subprocess.run(["ip", "netns", "add", squatter], check=True)
    try:
        with pytest.raises(ProviderError, match="already exists"):
            provider.launch(spec, lambda event: None)
        assert Path("/run/netns", squatter).exists(), "a namespace not ours was deleted"
        assert not (tmp_path / "cvms" / spec.id).exists()
        assert json.loads(identities.read_text()) == {"cvms": []}, "registered though not running"
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        assert prefix not in links
    finally:
        subprocess.run(["ip", "netns", "del", squatter], check=False)
