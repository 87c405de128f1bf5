"""The sandbox image CI builds (`sandbox-ci`: no compilers, no nested engine; the release builds
the full `sandbox`): a normal user with passwordless sudo, git and Python, Claude Code and Codex
from npm that start, CA variables pointing at the system bundle, placeholder credentials only."""

from __future__ import annotations

import json
import subprocess

import pytest

from umbra.images.build import BuildResult
from umbra.images.recipes import CA_BUNDLE, NPM_AGENTS

from .conftest import docker_up

pytestmark = pytest.mark.timeout(1500)

CHECK = (
    "set -e; id -un; sudo -n true && echo sudo-ok; git --version; python3.12 --version; "
    "node --version; claude --version; codex --version; "
    # The attested ingress's sshd runs its sftp subsystem inside the sandbox (scp, IDEs).
    "test -x /usr/lib/openssh/sftp-server && echo sftp-ok; env | sort"
)


def test_sandbox_ci_image_has_the_tools_and_the_agents_start(
    sandbox_ci_build: BuildResult,
) -> None:
    result = sandbox_ci_build
    (image,) = result.images
    npm = {i.uri for i in result.inputs if i.uri.startswith("pkg:npm/")}
    assert npm == {f"pkg:npm/{spec}" for spec in NPM_AGENTS}
    docker_up()
    subprocess.run(["docker", "load", "-i", str(image.archive)], check=True, capture_output=True)
    try:
        done = subprocess.run(
            ["docker", "run", "--rm", "--network", "none", "--user", "dev",
             "--entrypoint", "/bin/bash", image.config_digest, "-c", CHECK],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        lines = done.stdout.splitlines()
        print("\n".join(lines[:6]))
        assert lines[0] == "dev" and lines[1] == "sudo-ok" and "sftp-ok" in lines
        env = dict(line.split("=", 1) for line in lines if "=" in line)
        for var in ("NODE_EXTRA_CA_CERTS", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE", "GIT_SSL_CAINFO"):
            assert env[var] == CA_BUNDLE
        assert env["ANTHROPIC_API_KEY"] == env["OPENAI_API_KEY"] == "umbra-placeholder"
        inspect = subprocess.run(
            ["docker", "image", "inspect", image.config_digest],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert json.loads(inspect.stdout)[0]["Id"] == image.config_digest
    finally:
        subprocess.run(["docker", "rmi", "-f", image.config_digest], capture_output=True)
