"""The walkthrough's stand-in origin (`umbra up --check`): HTTPS on loopback with its own CA.

It answers every request with JSON saying what it received: method, path, whether an
Authorization header arrived (and the SHA-256 of its value, never the value) and the body's size.
Run: `python -m umbra.cli.demo_origin --cert C --key K --port P`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import ssl
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Handler(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        length = min(int(self.headers.get("Content-Length", "0") or 0), 1 << 20)
        body = self.rfile.read(length)
        auth = self.headers.get("Authorization")
        reply = {
            "origin": "umbra-demo",
            "method": self.command,
            "path": self.path,
            "authorization_sha256": hashlib.sha256(auth.encode()).hexdigest() if auth else None,
            "body_bytes": len(body),
        }
        raw = json.dumps(reply).encode() + b"\n"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    do_GET = do_POST = do_PUT = do_DELETE = _answer

    def log_message(self, format: str, *args: Any) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description="Stand-in origin for `umbra up --check`.")
    parser.add_argument("--cert", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(args.cert, args.key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
