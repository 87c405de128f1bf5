"""Deterministic container images without a registry: a rootfs directory becomes one layer tar
and a docker-archive (what `docker load` reads) plus the OCI manifest a registry would serve.

Same rootfs bytes and same SOURCE_DATE_EPOCH give the same layer, config and manifest digests:
entries are sorted, every mtime is the epoch, owners are numeric, devices are left to the
runtime, hard links are stored as files. The image id (`docker image inspect .Id`) is the config
digest; the registry-style digest (`name@sha256:…` in a compose file) is the manifest digest.
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

from pydantic import Field

from umbra.contracts.canonical import canonical_json
from umbra.contracts.model import Strict

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"


class _HashingWriter(io.RawIOBase):
    def __init__(self, out: BinaryIO) -> None:
        self.out = out
        self.sha = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = bytes(b)
        self.sha.update(data)
        self.size += len(data)
        self.out.write(data)
        return len(data)


def _entries(root: Path) -> list[Path]:
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        base = Path(dirpath)
        out.extend(base / d for d in dirnames)
        out.extend(base / f for f in sorted(filenames))
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def write_layer(root: Path, out: BinaryIO, epoch: int) -> tuple[str, int]:
    """Write `root` as an uncompressed, normalized tar; return (sha256 hex, size)."""
    sink = _HashingWriter(out)
    with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for path in _entries(root):
            st = path.lstat()
            info = tarfile.TarInfo(path.relative_to(root).as_posix())
            info.mtime = epoch
            info.uid, info.gid = st.st_uid, st.st_gid
            info.uname = info.gname = ""
            info.mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISDIR(st.st_mode):
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif stat.S_ISLNK(st.st_mode):
                info.type = tarfile.SYMTYPE
                info.linkname = os.readlink(path)
                tar.addfile(info)
            elif stat.S_ISREG(st.st_mode):
                info.size = st.st_size
                with path.open("rb") as f:
                    tar.addfile(info, f)
            # Sockets, fifos and device nodes are runtime state: the container runtime makes /dev.
    return sink.sha.hexdigest(), sink.size


class ImageConfig(Strict):
    """The runtime defaults an image carries (the OCI config's `config` object)."""

    Entrypoint: list[str] | None = None
    Cmd: list[str] | None = None
    User: str | None = None
    WorkingDir: str | None = None
    Env: list[str] = Field(default_factory=list)
    Labels: dict[str, str] = Field(default_factory=dict)


@dataclass(frozen=True)
class BuiltImage:
    name: str
    config_digest: str  # sha256:… = the image id Docker shows
    manifest_digest: str  # sha256:… = the digest a registry would serve
    layer_digest: str
    archive: Path

    @property
    def ref(self) -> str:
        return f"umbra/{self.name}@{self.manifest_digest}"


def image_config(
    layer_digest: str, cfg: ImageConfig, epoch: int, extra: Sequence[str] = ()
) -> bytes:
    """`extra`: the digests of layers on top of the shared one (the Console's tools)."""
    created = datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    layers = [layer_digest, *extra]
    history = [{"created": created, "created_by": "umbra image build"}]
    history += [{"created": created, "created_by": "umbra image build (tools)"} for _ in extra]
    return canonical_json(
        {
            "architecture": "amd64",
            "os": "linux",
            "created": created,
            "config": cfg.model_dump(exclude_none=True),
            "rootfs": {"type": "layers", "diff_ids": [f"sha256:{d}" for d in layers]},
            "history": history,
        }
    )


def oci_manifest(
    config: bytes, layer_digest: str, layer_size: int, extra: Sequence[tuple[str, int]] = ()
) -> bytes:
    return canonical_json(
        {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {
                "mediaType": OCI_CONFIG,
                "digest": "sha256:" + hashlib.sha256(config).hexdigest(),
                "size": len(config),
            },
            "layers": [
                {"mediaType": OCI_LAYER, "digest": f"sha256:{digest}", "size": size}
                for digest, size in [(layer_digest, layer_size), *extra]
            ],
        }
    )


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes, epoch: int) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), epoch, 0o644
    tar.addfile(info, io.BytesIO(data))


def write_archive(
    name: str,
    layer: Path,
    layer_digest: str,
    cfg: ImageConfig,
    out: Path,
    epoch: int,
    extra: Sequence[tuple[Path, str]] = (),
) -> BuiltImage:
    """A docker-archive around already written layers (the shared one, then `extra`: path and
    digest of each layer on top); the OCI manifest rides along in it."""
    layers = [(layer, layer_digest), *extra]
    config = image_config(layer_digest, cfg, epoch, [d for _, d in extra])
    config_hex = hashlib.sha256(config).hexdigest()
    layer_size = layer.stat().st_size
    manifest = oci_manifest(
        config, layer_digest, layer_size, [(d, p.stat().st_size) for p, d in extra]
    )
    docker_manifest = canonical_json(
        [
            {
                "Config": f"{config_hex}.json",
                "RepoTags": [f"umbra/{name}:{config_hex[:12]}"],
                "Layers": [f"{d}/layer.tar" for _, d in layers],
            }
        ]
    )
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for path, digest in layers:
            dirinfo = tarfile.TarInfo(digest)
            dirinfo.type, dirinfo.mtime, dirinfo.mode = tarfile.DIRTYPE, epoch, 0o755
            tar.addfile(dirinfo)
            info = tarfile.TarInfo(f"{digest}/layer.tar")
            info.size, info.mtime, info.mode = path.stat().st_size, epoch, 0o644
            with path.open("rb") as f:
                tar.addfile(info, f)
        _add_bytes(tar, f"{config_hex}.json", config, epoch)
        _add_bytes(tar, "manifest.json", docker_manifest, epoch)
        _add_bytes(tar, "oci-manifest.json", manifest, epoch)
    return BuiltImage(
        name=name,
        config_digest=f"sha256:{config_hex}",
        manifest_digest="sha256:" + hashlib.sha256(manifest).hexdigest(),
        layer_digest=f"sha256:{layer_digest}",
        archive=out,
    )


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
