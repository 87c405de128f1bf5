"""What each container image is made of: Debian packages, the project's wheel, runtime defaults.

Every Umbra service image (proxy, console, forwarder) shares one rootfs, `runtime`: the same
layer bytes, so one build, one set of inputs, one provenance subject per image. The sandbox is
not a container image: it is the mmdebstrap tree of sandbox/image.py, run by runc on the Dev CVM
as under `umbra up`, and shipped in the OS image (images/os_image.py, `sandbox_image`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from umbra.images.console_tools import POLICY_PACK_DIR, POLICY_PACK_ENV, PULUMI_DIR, Tool
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


class Rootfs(StrEnum):
    RUNTIME = "runtime"


@dataclass(frozen=True)
class Recipe:
    rootfs: Rootfs
    variant: str  # mmdebstrap variant
    packages: tuple[str, ...]
    npm: tuple[str, ...] = ()  # name@version, installed globally
    with_python: bool = True
    images: dict[str, ImageConfig] = field(default_factory=dict)
    # Images that get a second layer on top of the shared one, with these tools
    # (images/console_tools.py): the Console's Automation API runs need the Pulumi CLI and
    # the policy pack; the proxy does not carry them.
    tools: dict[str, tuple[Tool, ...]] = field(default_factory=dict)


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


def _service(
    cmd: list[str], user: str = "65534:65534", env: list[str] | None = None
) -> ImageConfig:
    return ImageConfig(Entrypoint=["/usr/bin/tini", "--"], Cmd=cmd, User=user, Env=env or _ENV)


_CONSOLE_ENV = [
    f"PATH={PULUMI_DIR}:{_ENV[0].removeprefix('PATH=')}",
    f"{POLICY_PACK_ENV}={POLICY_PACK_DIR}",
]


RECIPES: dict[Rootfs, Recipe] = {
    Rootfs.RUNTIME: Recipe(
        Rootfs.RUNTIME,
        variant="essential",
        # libstdc++6: the proxy's hyperscan extension links it (found by running the image).
        packages=(*PY_LIBS, "tini", "libstdc++6"),
        images={
            "proxy": _service(["umbra", "proxy", "serve"]),
            "console": _service(["umbra", "console", "serve"], env=_CONSOLE_ENV),
        },
        tools={"console": (Tool.PULUMI_CLI, Tool.POLICY_PACK)},
    ),
}
