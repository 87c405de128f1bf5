"""Images on a CVM without a registry: docker-archives (from `umbra image build`) loaded into the
local engine, each checked against the digest the measured compose file pins.

A loaded docker-archive has no registry digest (`RepoDigests` stays empty), so `name@sha256:M`
cannot be resolved by the engine itself. The store reads each archive's own OCI manifest, whose
SHA-256 *is* M, and its config, whose SHA-256 is the image id Docker assigns; both are checked
before the archive is loaded, so a compose pin M resolves to exactly the content it names.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

# Where the CVM OS image ships the release's archives and the launch agent's runner loads them.
IMAGES_DIR = Path("/usr/lib/umbra/images")
ARCHIVE_SUFFIX = ".docker.tar"


class ImageStoreError(Exception):
    """An archive is unreadable or inconsistent, or the engine refused it."""


@dataclass(frozen=True)
class LocalImage:
    manifest_digest: str  # sha256:… the compose pins
    image_id: str  # sha256:… the config digest, the id the engine shows
    archive: Path


def read_archive(archive: Path) -> LocalImage:
    """The archive's manifest digest and image id, after checking that its OCI manifest names
    the config it carries."""
    try:
        with tarfile.open(archive) as tar:
            oci = _member(tar, "oci-manifest.json")
            docker = json.loads(_member(tar, "manifest.json"))
            config_name = docker[0]["Config"]
            config = _member(tar, config_name)
    except (OSError, tarfile.TarError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ImageStoreError(f"{archive}: not an umbra docker-archive: {exc}") from None
    config_id = "sha256:" + hashlib.sha256(config).hexdigest()
    try:
        named = json.loads(oci)["config"]["digest"]
    except (ValueError, KeyError, TypeError):
        raise ImageStoreError(f"{archive}: oci-manifest.json has no config digest") from None
    if named != config_id or config_name != f"{config_id[7:]}.json":
        raise ImageStoreError(
            f"{archive}: the OCI manifest names {named}, the config is {config_id}"
        )
    return LocalImage("sha256:" + hashlib.sha256(oci).hexdigest(), config_id, archive)


def _member(tar: tarfile.TarFile, name: str) -> bytes:
    f = tar.extractfile(name)
    if f is None:
        raise KeyError(name)
    return f.read()


def load(archives: list[Path], docker: str = "docker") -> dict[str, str]:
    """Load every archive; returns manifest digest → image id."""
    out: dict[str, str] = {}
    for archive in sorted(archives):
        img = read_archive(archive)
        done = subprocess.run(
            [docker, "load", "-i", str(archive)], capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise ImageStoreError(f"docker load {archive}: {done.stderr.strip()}")
        out[img.manifest_digest] = img.image_id
    return out
