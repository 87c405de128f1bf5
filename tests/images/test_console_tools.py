"""The Console image's tools layer (images/console_tools.py): the recipe gives the console image,
and only it, the Pulumi CLI and the policy pack; a tarball whose SHA-256 is not the pin is refused
before it is read; the layer rides on top of the shared one in the docker-archive; the release
workflow fetches the CLI once per job with the one pin."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest
import yaml

from umbra.components.automation.provisioner import POLICY_PACK_ENV as PROVISIONER_PACK_ENV
from umbra.images.build import BuildError, build_rootfs
from umbra.images.console_tools import (
    POLICY_PACK_DIR,
    POLICY_PACK_ENV,
    POLICY_PACK_FILES,
    PULUMI_DIR,
    REPO_POLICY_PACK,
    ConsoleTools,
    PulumiPin,
    Tool,
    ToolError,
    install_console_tools,
)
from umbra.images.image_store import read_archive
from umbra.images.oci import ImageConfig, write_archive, write_layer
from umbra.images.recipes import RECIPES, Rootfs

ROOT = Path(__file__).resolve().parents[2]
EPOCH = 1700000000


def _tarball(path: Path, members: dict[str, bytes]) -> str:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o755
            tar.addfile(info, io.BytesIO(data))
    return hashlib.sha256(path.read_bytes()).hexdigest()


UPSTREAM = {
    "pulumi/pulumi": b"#!cli",
    "pulumi/pulumi-language-python": b"#!python host",
    "pulumi/pulumi-language-python-exec": b"#!python exec",
    "pulumi/pulumi-analyzer-policy-python": b"#!policy analyzer",
    "pulumi/pulumi-language-nodejs": b"#!nodejs host",
    "pulumi/pulumi-resource-pulumi-nodejs": b"#!nodejs",
}


def test_the_console_image_and_only_it_carries_the_pulumi_cli_and_the_policy_pack() -> None:
    recipe = RECIPES[Rootfs.RUNTIME]
    assert recipe.tools == {"console": (Tool.PULUMI_CLI, Tool.POLICY_PACK)}
    env = dict(e.split("=", 1) for e in recipe.images["console"].Env)
    assert env["PATH"].split(":")[0] == PULUMI_DIR
    assert env[POLICY_PACK_ENV] == POLICY_PACK_DIR
    # The provisioner reads the pack from where the image puts it.
    assert PROVISIONER_PACK_ENV == POLICY_PACK_ENV
    assert POLICY_PACK_ENV not in "".join(recipe.images["proxy"].Env)
    assert REPO_POLICY_PACK == ROOT / "infra/policy_pack"


def test_the_pinned_cli_and_the_pack_are_installed(tmp_path: Path) -> None:
    tgz = tmp_path / "pulumi.tgz"
    digest = _tarball(tgz, UPSTREAM)
    tree = tmp_path / "tree"
    got = install_console_tools(
        ConsoleTools(tgz, PulumiPin(version="3.200.0", sha256=digest)), tree
    )
    assert got == digest
    bin_dir = tree / PULUMI_DIR.lstrip("/")
    # Python's language host and policy analyzer only: the Console's programs are Python.
    assert sorted(p.name for p in bin_dir.iterdir()) == [
        "pulumi",
        "pulumi-analyzer-policy-python",
        "pulumi-language-python",
        "pulumi-language-python-exec",
    ]
    assert (bin_dir / "pulumi").read_bytes() == b"#!cli"
    assert (bin_dir / "pulumi").stat().st_mode & 0o777 == 0o755
    pack = tree / POLICY_PACK_DIR.lstrip("/")
    assert sorted(p.name for p in pack.iterdir()) == sorted(POLICY_PACK_FILES)
    rules = "umbra_policy_rules.py"
    assert (pack / rules).read_bytes() == (REPO_POLICY_PACK / rules).read_bytes()
    # No virtualenv: the image's interpreter (with pulumi-policy) runs it, no pip at `pulumi up`.
    assert yaml.safe_load((pack / "PulumiPolicy.yaml").read_text())["runtime"] == "python"


def test_a_tarball_that_is_not_the_pinned_one_is_refused_before_it_is_read(tmp_path: Path) -> None:
    tgz = tmp_path / "pulumi.tgz"
    digest = _tarball(tgz, UPSTREAM)
    pin = PulumiPin(version="3.200.0", sha256="0" * 64)
    tree = tmp_path / "tree"
    with pytest.raises(ToolError) as err:
        install_console_tools(ConsoleTools(tgz, pin), tree)
    assert f"SHA-256 {digest} is not the pinned {'0' * 64}" in str(err.value)
    assert not (tree / PULUMI_DIR.lstrip("/")).exists()


def test_a_tarball_without_the_cli_is_refused(tmp_path: Path) -> None:
    tgz = tmp_path / "pulumi.tgz"
    digest = _tarball(tgz, {"pulumi/pulumi-language-nodejs": b"x"})
    with pytest.raises(ToolError, match="no pulumi/pulumi, pulumi/pulumi-language-python"):
        install_console_tools(
            ConsoleTools(tgz, PulumiPin(version="3.1.0", sha256=digest)), tmp_path
        )


@pytest.mark.parametrize("pin", [{"version": "latest", "sha256": "0" * 64},
                                 {"version": "3.1.0", "sha256": "ABC"}])  # fmt: skip
def test_a_pin_is_a_version_and_a_digest(pin: dict[str, str]) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        PulumiPin.model_validate(pin)


def test_a_build_without_the_tools_is_refused_unless_it_says_so(tmp_path: Path) -> None:
    with pytest.raises(BuildError, match=r"--pulumi-cli .* or --without-tools"):
        build_rootfs(
            Rootfs.RUNTIME,
            tmp_path / "out",
            wheel=tmp_path / "w.whl",
            requirements=tmp_path / "r.txt",
            host_python_prefix=tmp_path,
            epoch=EPOCH,
        )


def test_the_tools_layer_rides_on_top_of_the_shared_one(tmp_path: Path) -> None:
    def layer(name: str, content: bytes) -> tuple[Path, str]:
        tree = tmp_path / f"{name}-tree"
        tree.mkdir()
        (tree / name).write_bytes(content)
        path = tmp_path / f"{name}.tar"
        with path.open("wb") as f:
            digest, _ = write_layer(tree, f, EPOCH)
        return path, digest

    (base, base_hex), (tools, tools_hex) = layer("base", b"b"), layer("tools", b"t")
    cfg = ImageConfig(Cmd=["umbra", "console", "serve"])
    img = write_archive(
        "console", base, base_hex, cfg, tmp_path / "c.tar", EPOCH, [(tools, tools_hex)]
    )
    assert read_archive(img.archive).manifest_digest == img.manifest_digest
    with tarfile.open(img.archive) as tar:

        def doc(name: str) -> object:
            f = tar.extractfile(name)
            assert f is not None
            return json.loads(f.read())

        oci = doc("oci-manifest.json")
        docker = doc("manifest.json")
        assert isinstance(oci, dict) and isinstance(docker, list)
        assert [x["digest"] for x in oci["layers"]] == [f"sha256:{base_hex}", f"sha256:{tools_hex}"]
        assert docker[0]["Layers"] == [f"{base_hex}/layer.tar", f"{tools_hex}/layer.tar"]
        config = doc(docker[0]["Config"])
        assert isinstance(config, dict)
        assert config["rootfs"]["diff_ids"] == [f"sha256:{base_hex}", f"sha256:{tools_hex}"]
        assert len(config["history"]) == 2
    # Without the tools the image is the one-layer image it was.
    plain = write_archive("proxy", base, base_hex, cfg, tmp_path / "p.tar", EPOCH)
    assert plain.manifest_digest != img.manifest_digest


def test_the_release_workflow_fetches_the_cli_with_one_pin_for_both_jobs() -> None:
    flow = yaml.safe_load((ROOT / ".github/workflows/release-images.yml").read_text())
    fetches = {
        job: step["env"]
        for job, spec in flow["jobs"].items()
        for step in spec["steps"]
        if "scripts/fetch-pulumi-cli" in step.get("run", "")
    }
    assert set(fetches) == {"build", "publish-os-image"}
    for env in fetches.values():
        assert env == {
            "PULUMI_VERSION": "${{ vars.PULUMI_VERSION }}",
            "PULUMI_SHA256": "${{ vars.PULUMI_SHA256 }}",
        }
    (build,) = [s for s in flow["jobs"]["build"]["steps"] if "image build" in s.get("run", "")]
    assert "--pulumi-cli" in build["run"]
    script = (ROOT / "scripts/fetch-pulumi-cli").read_text()
    assert "sha256sum -c" in script and "PULUMI_SHA256" in script
