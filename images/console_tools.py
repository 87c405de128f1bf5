"""What the Console image carries for its Automation API runs (components/automation): the Pulumi
CLI and the Umbra policy pack, in a layer of their own on top of the shared `runtime` layer (the
proxy image does not carry them).

The CLI is not a Debian package: the release workflow fetches the upstream tarball for the pinned
version and this module refuses it unless its SHA-256 is the pinned one (the repository variables
PULUMI_VERSION and PULUMI_SHA256, one pin shared with the images stack's job). Only the language
host and policy analyzer for Python are kept: the Console's programs are Python. The policy pack
is copied from infra/policy_pack with its `virtualenv` option dropped: the image's interpreter
already has pulumi-policy (a locked dependency), so no pip runs at `pulumi up` (the Console VM
may reach no package index). The Console finds both through its image's environment
(PATH, UMBRA_POLICY_PACK)."""

from __future__ import annotations

import os
import shutil
import tarfile
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import yaml
from pydantic import Field

from umbra.contracts.model import Strict
from umbra.images.oci import file_sha256

PULUMI_DIR = "/opt/pulumi/bin"
POLICY_PACK_DIR = "/opt/umbra/policy_pack"
POLICY_PACK_ENV = "UMBRA_POLICY_PACK"
REPO_POLICY_PACK = Path(__file__).resolve().parents[1] / "infra" / "policy_pack"
POLICY_PACK_FILES = (
    "PulumiPolicy.yaml",
    "__main__.py",
    "umbra_policy_rules.py",
    "requirements.txt",
)
# The upstream tarball's members kept (under its top `pulumi/` directory).
_KEEP_PREFIXES = ("pulumi-language-python", "pulumi-analyzer-policy")
_REQUIRED_BINARIES = ("pulumi", "pulumi-language-python")


class Tool(StrEnum):
    PULUMI_CLI = "pulumi-cli"
    POLICY_PACK = "policy-pack"


class ToolError(Exception):
    """A tool input is refused; the message says which and why."""


class PulumiPin(Strict):
    version: Annotated[str, Field(pattern=r"^[0-9]+\.[0-9]+\.[0-9]+$")]
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]

    @property
    def url(self) -> str:
        return f"https://get.pulumi.com/releases/sdk/pulumi-v{self.version}-linux-x64.tar.gz"


@dataclass(frozen=True)
class ConsoleTools:
    """The fetched tarball, its pin, and the policy pack's source directory."""

    pulumi_tarball: Path
    pin: PulumiPin
    policy_pack: Path = REPO_POLICY_PACK


def install_pulumi_cli(tarball: Path, pin: PulumiPin, root: Path) -> str:
    """Checks the tarball against the pin before reading a byte of it; returns its SHA-256."""
    got = file_sha256(tarball)
    if got != pin.sha256:
        raise ToolError(
            f"{tarball.name}: SHA-256 {got} is not the pinned {pin.sha256} "
            f"(Pulumi CLI {pin.version}): refused"
        )
    dest = root / PULUMI_DIR.lstrip("/")
    dest.mkdir(parents=True, exist_ok=True)
    kept: list[str] = []
    with tarfile.open(tarball, "r:gz") as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts
            if len(parts) != 2 or parts[0] != "pulumi" or not member.isfile():
                continue
            name = parts[1]
            if name != "pulumi" and not name.startswith(_KEEP_PREFIXES):
                continue
            src = tar.extractfile(member)
            assert src is not None
            with src, (dest / name).open("wb") as out:
                shutil.copyfileobj(src, out)
            (dest / name).chmod(0o755)
            kept.append(name)
    missing = [b for b in _REQUIRED_BINARIES if b not in kept]
    if missing:
        raise ToolError(f"{tarball.name}: no pulumi/{', pulumi/'.join(missing)} in the tarball")
    return got


def install_policy_pack(source: Path, root: Path) -> None:
    dest = root / POLICY_PACK_DIR.lstrip("/")
    dest.mkdir(parents=True, exist_ok=True)
    for name in POLICY_PACK_FILES:
        if not (source / name).is_file():
            raise ToolError(f"{source / name}: the policy pack's file is missing")
        shutil.copyfile(source / name, dest / name)
    project = yaml.safe_load((source / "PulumiPolicy.yaml").read_text())
    runtime = project.get("runtime") if isinstance(project, dict) else None
    if not isinstance(runtime, dict) or runtime.get("name") != "python":
        raise ToolError(f"{source / 'PulumiPolicy.yaml'}: want a python runtime")
    # The image's interpreter runs it (pulumi-policy is installed): no virtualenv, no pip.
    project["runtime"] = "python"
    (dest / "PulumiPolicy.yaml").write_text(yaml.safe_dump(project, sort_keys=True))


def install_console_tools(tools: ConsoleTools, root: Path) -> str:
    """Both tools into `root` (the Console layer's tree), owned by root, world-readable."""
    digest = install_pulumi_cli(tools.pulumi_tarball, tools.pin, root)
    install_policy_pack(tools.policy_pack, root)
    if os.geteuid() == 0:
        for path in (root, *root.rglob("*")):
            os.lchown(path, 0, 0)
    return digest
