"""Real tools through the real proxy: curl, `git clone` from git http-backend, `pip install` from a
PEP 503 index. The git server and the index demand a credential the sandbox does not have; only the
proxy's injection makes them work."""

from __future__ import annotations

import base64
import hashlib
import io
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from tests.proxy.conftest import Env
from tests.proxy.harness import (
    ALICE_TOKEN,
    PYPI_SECRET,
    TEAM_SECRET,
    OriginHandler,
    Seen,
    curl,
    curl_status,
)


def _clean_env() -> dict[str, str]:
    """The environment without CA-bundle and pip overrides a developer machine may carry."""
    drop = (
        "REQUESTS_CA_BUNDLE",
        "CURL_CA_BUNDLE",
        "SSL_CERT_FILE",
        "SSL_CERT_DIR",
        "GIT_SSL_CAINFO",
    )
    return {
        key: value
        for key, value in os.environ.items()
        if key not in drop and not key.startswith("PIP_") and "PROXY" not in key.upper()
    }


def _basic(user: str, secret: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{secret}".encode()).decode()


def _git_route(root: Path) -> object:
    expected = _basic("x-access-token", TEAM_SECRET)

    def route(handler: OriginHandler, seen: Seen) -> None:
        if seen.header("authorization") != [expected]:
            handler.send(401, b"auth required\n", {"www-authenticate": 'Basic realm="git"'})
            return
        path, _, query = seen.path.partition("?")
        env = {
            "GIT_PROJECT_ROOT": str(root),
            "GIT_HTTP_EXPORT_ALL": "1",
            "PATH_INFO": path,
            "QUERY_STRING": query,
            "REQUEST_METHOD": seen.method,
            "CONTENT_TYPE": (seen.header("content-type") or [""])[0],
            "CONTENT_LENGTH": str(len(seen.body)),
            "REMOTE_USER": "x-access-token",
            "REMOTE_ADDR": "127.0.0.1",
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        }
        encoding = (seen.header("content-encoding") or [""])[0]
        if encoding:
            env["HTTP_CONTENT_ENCODING"] = encoding
        result = subprocess.run(
            ["git", "http-backend"], input=seen.body, env=env, capture_output=True, check=False
        )
        head, _, body = result.stdout.partition(b"\r\n\r\n")
        status, headers = 200, {}
        for line in head.decode("latin-1").split("\r\n"):
            name, _, value = line.partition(":")
            if name.lower() == "status":
                status = int(value.strip().split()[0])
            elif name:
                headers[name.strip()] = value.strip()
        handler.send(status, body, headers)

    return route


def test_git_clone_over_https_with_injected_credential(env: Env, tmp_path: Path) -> None:
    repos = tmp_path / "repos"
    work = tmp_path / "work"
    work.mkdir()
    git_env = {
        **_clean_env(),
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_CONFIG_NOSYSTEM": "1",
        "HOME": str(tmp_path),
    }
    subprocess.run(["git", "init", "-q", "-b", "main", str(work)], check=True, env=git_env)
    (work / "README.md").write_text("hello from the git origin\n")
    subprocess.run(["git", "-C", str(work), "add", "."], check=True, env=git_env)
    subprocess.run(
        [
            "git",
            "-C",
            str(work),
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@t",
            "commit",
            "-qm",
            "init",
        ],
        check=True,
        env=git_env,
    )
    subprocess.run(
        ["git", "clone", "-q", "--bare", str(work), str(repos / "demo.git")],
        check=True,
        env=git_env,
    )
    env.origin.routes["git.test"] = _git_route(repos)  # type: ignore[assignment]
    mark = env.proxy.log.mark()
    clone = tmp_path / "clone"
    result = subprocess.run(
        [
            "git",
            "-c",
            f"http.proxy=http://cvm-alice:{ALICE_TOKEN}@127.0.0.1:{env.proxy.port}",
            "-c",
            "http.proxyAuthMethod=basic",
            "-c",
            f"http.sslCAInfo={env.proxy.ca}",
            "clone",
            "-q",
            f"https://git.test:{env.origin.port}/demo.git",
            str(clone),
        ],
        capture_output=True,
        text=True,
        env=git_env,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, (
        result.stderr,
        [(r["reason"], r["injected_headers"], r["status"]) for r in env.proxy.log.settled()[mark:]],
        [
            x.header("authorization") == [_basic("x-access-token", TEAM_SECRET)]
            for x in env.recorder.snapshot()
            if x.host.startswith("git.test")
        ],
    )
    assert (clone / "README.md").read_text() == "hello from the git origin\n"
    env.proxy.log.wait_for(mark, lambda r: r["connect_host"] == "git.test")
    records = env.proxy.log.settled()[mark:]
    allowed = [r for r in records if r["decision"] == "allow" and r["connect_host"] == "git.test"]
    assert allowed and all(r["injected_headers"] == ["Authorization"] for r in allowed)
    assert TEAM_SECRET not in result.stderr


def _wheel() -> tuple[str, bytes]:
    name = "umbra_demo-0.1-py3-none-any.whl"
    files = {
        "umbra_demo/__init__.py": b"VALUE = 'installed through umbra'\n",
        "umbra_demo-0.1.dist-info/METADATA": b"Metadata-Version: 2.1\nName: umbra-demo\nVersion: 0.1\n",
        "umbra_demo-0.1.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record_lines = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record_lines.append(f"{path},sha256={digest},{len(data)}")
    record_lines.append("umbra_demo-0.1.dist-info/RECORD,,")
    files["umbra_demo-0.1.dist-info/RECORD"] = ("\n".join(record_lines) + "\n").encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for path, data in files.items():
            archive.writestr(path, data)
    return name, buffer.getvalue()


@pytest.fixture(scope="module")
def pip_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("pipvenv")
    base = Path(getattr(sys, "_base_executable", sys.executable))
    subprocess.run(
        [str(base), "-m", "venv", str(directory)], check=True, capture_output=True, timeout=120
    )
    if not (directory / "bin" / "pip").exists():
        venv.EnvBuilder(with_pip=True).create(directory)
    return directory


def test_pip_install_from_index_with_injected_credential(
    env: Env, tmp_path: Path, pip_venv: Path
) -> None:
    wheel_name, wheel = _wheel()
    digest = hashlib.sha256(wheel).hexdigest()
    expected = _basic("pip", PYPI_SECRET)

    def route(handler: OriginHandler, seen: Seen) -> None:
        if seen.header("authorization") != [expected]:
            handler.send(401, b"auth required\n", {"www-authenticate": 'Basic realm="pypi"'})
        elif seen.path.rstrip("/") == "/simple/umbra-demo":
            page = f'<html><body><a href="/files/{wheel_name}#sha256={digest}">{wheel_name}</a></body></html>'
            handler.send(200, page.encode(), {"content-type": "text/html"})
        elif seen.path == f"/files/{wheel_name}":
            handler.send(200, wheel, {"content-type": "application/octet-stream"})
        else:
            handler.send(404, b"not found\n")

    env.origin.routes["pypi.test"] = route
    mark = env.proxy.log.mark()
    target = tmp_path / "site"
    result = subprocess.run(
        [
            str(pip_venv / "bin" / "pip"),
            "install",
            "--disable-pip-version-check",
            "--no-cache-dir",
            "--no-deps",
            "--target",
            str(target),
            "--index-url",
            f"https://pypi.test:{env.origin.port}/simple/",
            "--proxy",
            f"http://cvm-alice:{ALICE_TOKEN}@127.0.0.1:{env.proxy.port}",
            "--cert",
            str(env.proxy.ca),
            "umbra-demo",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env={**_clean_env(), "PIP_CONFIG_FILE": os.devnull},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "installed through umbra" in (target / "umbra_demo" / "__init__.py").read_text()
    env.proxy.log.wait_for(
        mark, lambda r: r["connect_host"] == "pypi.test" and r["injected_headers"]
    )
    assert PYPI_SECRET not in result.stdout + result.stderr


def test_curl_denied_destination_gets_a_clear_answer(env: Env) -> None:
    result = curl(env.proxy, f"https://evil.test:{env.origin.port}/", "-i")
    assert curl_status(result) == 403
    assert "x-umbra-reason: no_matching_rule" in result.stdout.lower()
    assert shutil.which("curl")


def test_curl_over_http2_gets_injected_credential(env: Env) -> None:
    mark = env.proxy.log.mark()
    result = curl(
        env.proxy,
        f"https://api.test:{env.origin.port}/h2-ok",
        "--http2",
        "-w",
        "\n%{http_code} %{http_version}",
    )
    assert result.returncode == 0, result.stderr
    status, version = result.stdout.rsplit("\n", 1)[-1].split()
    assert status == "200" and version == "2"
    seen = [s for s in env.recorder.snapshot() if s.path == "/h2-ok"][-1]
    assert seen.header("authorization") == [f"Bearer {TEAM_SECRET}"]
    assert TEAM_SECRET not in result.stdout
    env.proxy.log.wait_for(mark, lambda r: r["decision"] == "allow" and r["path"] == "/h2-ok")
