"""`umbra <command> --help` imports only what renders help: no Console app, proxy engine, Pulumi,
HTTP client, TLS/attestation libraries or templates. Asserts the *imports* (timing is in
benchmarks/cli_help_bench.py): one fresh interpreter imports the top level, then forks once per
command, so each child starts from exactly what `umbra --help` already loads."""

from __future__ import annotations

import json
import subprocess
import sys

from umbra.cli.app import COMMANDS, SUBCOMMANDS

# Heavy, and needed only by a command that runs. (pydantic and rich are not here: typer's rich
# help and the option models of some groups need them.)
FORBIDDEN = (
    "umbra.console.app",
    "umbra.console.client",
    "fastapi",
    "starlette",
    "sqlalchemy",
    "sqlmodel",
    "alembic",
    "uvicorn",
    "mitmproxy",
    "pulumi",
    "httpx",
    "OpenSSL",
    "dcap_qvl",
    "jinja2",
)
# cryptography where it is avoidable: not for the policy tools (the policy package loads its
# signed-bundle module) nor `attest` (quote parsing uses it), which are kept as they were.
CRYPTO_OK = {"policy", "attest"}

WRAPPER = r"""
import contextlib, io, json, os, sys
sys.argv = ["umbra"]
from umbra.cli.app import app
names, forbidden = json.loads(sys.argv_json)
result = {}
for name in names:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        sys.argv = ["umbra", name, "--help"]
        out = io.StringIO()
        code = 0
        with contextlib.redirect_stdout(out):
            try:
                app()
            except SystemExit as exc:
                code = exc.code or 0
        loaded = sorted(m for m in sys.modules if m.startswith(tuple(forbidden)))
        crypto = "cryptography" in sys.modules
        os.write(w, json.dumps([code, out.getvalue(), loaded, crypto]).encode())
        os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 1 << 16):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    result[name] = json.loads(b"".join(chunks))
print(json.dumps(result))
"""


def test_no_command_help_imports_a_heavy_module() -> None:
    names = sorted([*SUBCOMMANDS, *COMMANDS])
    code = WRAPPER.replace("sys.argv_json", repr(json.dumps([names, FORBIDDEN])))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout)
    assert set(results) == set(names)
    for name, (exit_code, text, loaded, crypto) in results.items():
        assert exit_code == 0, (name, text)
        assert "Usage:" in text and "--help" in text, (name, text)  # typer's help, intact
        assert loaded == [], f"`umbra {name} --help` imported {loaded}"
        if name not in CRYPTO_OK:
            assert not crypto, f"`umbra {name} --help` imported cryptography"
