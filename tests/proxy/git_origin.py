"""A git smart-HTTP origin on loopback: Debian's `git http-backend` (CGI) behind a tiny TLS
server, serving bare repositories under one directory, pushes enabled (a fixed REMOTE_USER)."""

from __future__ import annotations

import os
import ssl
import subprocess
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from tests.proxy.harness import TlsHttpServer

HTTP_BACKEND = "/usr/lib/git-core/git-http-backend"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: GitOrigin

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _body(self) -> bytes:
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(self.rfile.readline().strip().split(b";")[0], 16)
                if size == 0:
                    while self.rfile.readline().strip():
                        pass
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        length = int(self.headers.get("content-length") or 0)
        return self.rfile.read(length) if length else b""

    def _cgi(self) -> None:
        body = self._body()
        path, _, query = self.path.partition("?")
        self.server.requests.append((self.command, path))
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "GIT_PROJECT_ROOT": str(self.server.root),
            "GIT_HTTP_EXPORT_ALL": "1",
            "GIT_CONFIG_NOSYSTEM": "1",
            "HOME": str(self.server.root),
            "REMOTE_USER": "agent",
            "REMOTE_ADDR": "127.0.0.1",
            "REQUEST_METHOD": self.command,
            "PATH_INFO": path,
            "QUERY_STRING": query,
            "CONTENT_TYPE": self.headers.get("content-type", ""),
            "CONTENT_LENGTH": str(len(body)),
        }
        if self.headers.get("content-encoding"):
            env["HTTP_CONTENT_ENCODING"] = self.headers["content-encoding"]
        if self.headers.get("git-protocol"):
            env["GIT_PROTOCOL"] = self.headers["git-protocol"]
        result = subprocess.run(
            [HTTP_BACKEND], input=body, env=env, capture_output=True, timeout=60, check=False
        )
        head, sep, payload = result.stdout.partition(b"\r\n\r\n")
        if not sep:
            head, sep, payload = result.stdout.partition(b"\n\n")
        status = 200
        headers: list[tuple[str, str]] = []
        for line in head.decode("latin-1").splitlines():
            name, _, value = line.partition(":")
            if name.lower() == "status":
                status = int(value.strip().split()[0])
            elif name:
                headers.append((name, value.strip()))
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = _cgi


class GitOrigin(TlsHttpServer):
    socket_timeout = 30.0  # a push's pack takes a while to arrive

    def __init__(self, root: Path, tls: ssl.SSLContext) -> None:
        super().__init__(_Handler, tls)
        self.root = root
        self.requests: list[tuple[str, str]] = []
        self.start()

    def bare(self, name: str) -> Path:
        path = self.root / name
        subprocess.run(["git", "init", "-q", "--bare", str(path)], check=True)
        return path

    def refs(self, name: str) -> dict[str, str]:
        out = subprocess.run(
            [
                "git",
                "-C",
                str(self.root / name),
                "for-each-ref",
                "--format=%(refname) %(objectname)",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return {ref: oid for ref, _, oid in (line.partition(" ") for line in out.splitlines())}
