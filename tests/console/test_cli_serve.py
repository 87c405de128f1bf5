"""`umbra console serve` on the embedded default: migrates at startup when asked, then serves."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.console.postgres import free_port


def test_serve_migrates_sqlite_and_answers(tmp_path: Path) -> None:
    port = free_port()
    env = {
        **os.environ,
        "UMBRA_CONSOLE_DATABASE_URL": f"sqlite:///{tmp_path}/console.db",
        "UMBRA_CONSOLE_OIDC_ISSUER": "https://issuer.invalid",
    }
    umbra = Path(sys.executable).parent / "umbra"
    process = subprocess.Popen(
        [str(umbra), "console", "serve", "--port", str(port), "--migrate"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                response = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2)
                if response.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None, process.stdout.read() if process.stdout else ""
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert response.json() == {"status": "ready"}
        spec = httpx.get(f"http://127.0.0.1:{port}/openapi.json", timeout=5).json()
        assert "/api/v1/traffic/batches" in spec["paths"]
        assert "TrafficBatch" in spec["components"]["schemas"]
    finally:
        process.terminate()
        process.wait(timeout=20)


def test_serve_refuses_bad_configuration(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "UMBRA_CONSOLE_DATABASE_URL": "mysql://x",
        "UMBRA_CONSOLE_PROVIDERS": "gcp",
    }
    umbra = Path(sys.executable).parent / "umbra"
    result = subprocess.run(
        [str(umbra), "console", "serve"], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert "UMBRA_CONSOLE_DATABASE_URL" in result.stdout + result.stderr
    env["UMBRA_CONSOLE_DATABASE_URL"] = f"sqlite:///{tmp_path}/c.db"
    result = subprocess.run(
        [str(umbra), "console", "serve"], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert "'gcp' is enabled but GCP is not set" in " ".join(
        (result.stdout + result.stderr).split()
    )
