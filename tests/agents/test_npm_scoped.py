"""The real `npm` installs a scoped package through the real proxy: npm asks for `/@scope%2fname`,
which the policy engine used to refuse as `invalid_path` (this test fails on that code)."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agents.stack import Stack, start_stack
from tests.proxy.harness import OriginHandler, Seen

REGISTRY = "registry.npmjs.org"
PACKAGE = "@umbra-test/hello"

NPM_PROFILE = """
apiVersion: umbra/v1
kind: Profile
name: npm
egress:
  - id: registry-read
    allow: {hosts: [registry.npmjs.org], methods: [GET, HEAD], ports: [{port}], paths: ["/@umbra-test/**"]}
  - id: no-account
    deny: {hosts: [registry.npmjs.org], ports: [{port}], paths: ["/-/user/**"]}
"""

pytestmark = pytest.mark.skipif(shutil.which("npm") is None, reason="npm is not installed")


def _tarball() -> bytes:
    files = {
        "package/package.json": json.dumps({"name": PACKAGE, "version": "1.0.0", "main": "i.js"}),
        "package/i.js": "module.exports = 'installed through umbra';\n",
    }
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as archive:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            archive.addfile(info, io.BytesIO(data))
    return raw.getvalue()


def _registry_route(port: int) -> object:
    tarball = _tarball()
    integrity = "sha512-" + base64.b64encode(hashlib.sha512(tarball).digest()).decode()
    tarball_url = f"https://{REGISTRY}:{port}/{PACKAGE}/-/hello-1.0.0.tgz"
    packument = {
        "name": PACKAGE,
        "dist-tags": {"latest": "1.0.0"},
        "versions": {
            "1.0.0": {
                "name": PACKAGE,
                "version": "1.0.0",
                "main": "i.js",
                "dist": {"tarball": tarball_url, "integrity": integrity},
            }
        },
    }

    def route(handler: OriginHandler, seen: Seen) -> None:
        if seen.path.lower() == "/@umbra-test%2fhello":
            handler.send(200, json.dumps(packument).encode(), {"content-type": "application/json"})
        elif seen.path == f"/{PACKAGE}/-/hello-1.0.0.tgz":
            handler.send(200, tarball, {"content-type": "application/octet-stream"})
        else:
            handler.send(404, b'{"error":"not found"}', {"content-type": "application/json"})

    return route


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    running = start_stack(
        tmp_path_factory.mktemp("npm"), [REGISTRY], {"npm": NPM_PROFILE}, attached=["npm"]
    )
    running.origin.routes[REGISTRY] = _registry_route(running.origin.port)  # type: ignore[assignment]
    yield running
    running.stop()


def _npm(stack: Stack, project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    home = project / "home"
    home.mkdir(exist_ok=True)
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "npm_config_userconfig": str(home / ".npmrc"),
        "npm_config_cache": str(project / "npm-cache"),
        "npm_config_update_notifier": "false",
    }
    return subprocess.run(
        [
            "npm", *args,
            "--registry", f"https://{REGISTRY}:{stack.origin.port}/",
            "--https-proxy", stack.proxy_url, "--proxy", stack.proxy_url,
            "--cafile", str(stack.proxy.ca), "--strict-ssl",
            "--no-audit", "--no-fund", "--fetch-retries", "0", "--fetch-timeout", "20000",
        ],
        cwd=project, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_npm_installs_a_scoped_package_through_the_proxy(stack: Stack, tmp_path: Path) -> None:
    (tmp_path / "package.json").write_text('{"name": "app", "version": "1.0.0"}')
    mark = stack.proxy.log.mark()
    result = _npm(stack, tmp_path, "install", PACKAGE)
    assert result.returncode == 0, result.stdout + result.stderr
    installed = tmp_path / "node_modules" / "@umbra-test" / "hello" / "i.js"
    assert "installed through umbra" in installed.read_text()
    # npm asked with the encoded slash; the registry received exactly what npm sent.
    paths = [seen.path for seen in stack.recorder.snapshot()]
    assert "/@umbra-test%2fhello" in paths
    record = stack.proxy.log.wait_for(
        mark, lambda r: r["decision"] == "allow" and r["path"] == "/@umbra-test%2Fhello"
    )
    assert record["rule_id"] == "npm:registry-read"


def test_an_encoded_slash_does_not_reach_a_denied_path(stack: Stack, tmp_path: Path) -> None:
    result = _npm(stack, tmp_path, "view", "@umbra-test/../-/user/x")
    assert result.returncode != 0
    before = len(stack.recorder.snapshot())
    # The same through curl, spelled every way a server might decode into the denied path.
    for path in ("/-%2fuser%2fx", "/-%2Fuser/x", "/@umbra-test%2f..%2f-%2fuser%2fx"):
        done = subprocess.run(
            [
                "curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "--path-as-is",
                "--proxy", stack.proxy_url, "--cacert", str(stack.proxy.ca),
                f"https://{REGISTRY}:{stack.origin.port}{path}",
            ],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert done.stdout in ("403", "400"), (path, done.stdout, done.stderr)
    assert len(stack.recorder.snapshot()) == before, "a denied spelling reached the registry"


def test_npm_shows_the_denial_sentence(stack: Stack, tmp_path: Path) -> None:
    """npm prints a JSON body's `error` after the status: the agent reads why, and what to ask."""
    result = _npm(stack, tmp_path, "view", "@other-scope/pkg")
    assert result.returncode != 0
    assert "umbra: denied (no_matching_rule): GET https://registry.npmjs.org" in result.stderr
    assert "attached profiles: npm" in result.stderr
