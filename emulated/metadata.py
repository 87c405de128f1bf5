"""A metadata stand-in that answers like the cloud the guest was booted as, for one VM:

- GCP's metadata server (`169.254.169.254`): `/computeMetadata/v1/…` only with
  `Metadata-Flavor: Google` (403 without; every answer carries the header back), the instance
  attributes (the launch data, `LaunchData.gcp_metadata()`: what components.gcp_vm sets) as a
  directory listing, one value per key, or `?recursive=true` JSON; guest attributes written with
  PUT (the launch agent's ready report is `umbra/ready` = the compose hash).
- Azure's IMDS (`169.254.169.254`): `/metadata/…` only with `Metadata: true` and an
  `api-version` (400 without), `compute/userData` (base64, `LaunchData.azure_user_data()`: what
  components.azure_vm sets), refused when proxied (`X-Forwarded-For`); and the wire server
  (`168.63.129.16`): the goal state (`x-ms-version` required) and the health report, accepted
  only for the current incarnation, container and instance with state `Ready`.

The guest reaches it on those addresses through QEMU user networking (emulated.qemu): nothing
here listens anywhere but loopback. Each `restart()` (a stop and start) is a new goal-state
incarnation, as a re-created Azure VM gets.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from umbra.components.launch_data import LaunchData

METADATA_ADDRESS = "169.254.169.254"
WIRE_SERVER_ADDRESS = "168.63.129.16"
GCP_ATTRIBUTES = "/computeMetadata/v1/instance/attributes/"
GCP_GUEST_ATTRIBUTES = "/computeMetadata/v1/instance/guest-attributes/"
AZURE_USER_DATA = "/metadata/instance/compute/userData"
WIRE_VERSION = "2012-11-30"


class Shape(StrEnum):
    """The cloud the emulated VM is booted as (SMBIOS, metadata protocol)."""

    gcp = "gcp"
    azure = "azure"


@dataclass(frozen=True)
class ReadyReport:
    shape: Shape
    boot: int  # which boot of this VM (1 = launch; +1 per restart)
    detail: str  # GCP: the reported compose hash; Azure: `incarnation/container/instance`


@dataclass
class _State:
    launch: LaunchData
    boot: int = 1
    container_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    ready: list[ReadyReport] = field(default_factory=list)
    guest_attributes: dict[str, str] = field(default_factory=dict)
    requests: list[str] = field(default_factory=list)


class EmulatedMetadata:
    """The stand-in for one VM: `metadata_port` (169.254.169.254:80 in the guest) and
    `wire_port` (168.63.129.16:80), both on 127.0.0.1."""

    def __init__(self, shape: Shape, launch: LaunchData, instance_id: str) -> None:
        self.shape = Shape(shape)
        self.instance_id = instance_id
        self._lock = threading.Condition()
        self._state = _State(launch)
        self._servers: list[ThreadingHTTPServer] = []
        self.metadata_port = 0
        self.wire_port = 0

    # ---- what the test or provider sees -----------------------------------------------------

    @property
    def launch(self) -> LaunchData:
        with self._lock:
            return self._state.launch

    def set_launch(self, launch: LaunchData) -> None:
        """New launch data (an update: the provider restarts the VM with it)."""
        with self._lock:
            self._state.launch = launch

    def restart(self) -> None:
        """A stop and start: the next boot, a new goal-state incarnation and container."""
        with self._lock:
            self._state.boot += 1
            self._state.container_id = str(uuid.uuid4())

    @property
    def ready(self) -> list[ReadyReport]:
        with self._lock:
            return list(self._state.ready)

    @property
    def requests(self) -> list[str]:
        with self._lock:
            return list(self._state.requests)

    def wait_ready(self, boot: int, timeout: float) -> ReadyReport | None:
        """The ready report of boot `boot`, once it arrives (None after `timeout` s)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                found = [r for r in self._state.ready if r.boot == boot]
                if found:
                    return found[0]
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._lock.wait(min(left, 5))

    # ---- serving ----------------------------------------------------------------------------

    def start(self) -> EmulatedMetadata:
        for which in ("metadata", "wire"):
            server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler(which))
            server.daemon_threads = True
            threading.Thread(target=server.serve_forever, daemon=True).start()
            self._servers.append(server)
        self.metadata_port = self._servers[0].server_address[1]
        self.wire_port = self._servers[1].server_address[1]
        return self

    def stop(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()
        self._servers.clear()

    @contextmanager
    def serving(self) -> Iterator[EmulatedMetadata]:
        self.start()
        try:
            yield self
        finally:
            self.stop()

    def _handler(self, which: str) -> type[BaseHTTPRequestHandler]:
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "Metadata Server for VM" if stand_in.shape is Shape.gcp else "IMDS"
            sys_version = ""

            def log_message(self, *args: Any) -> None:
                return None

            def _body(self) -> bytes:
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length > 0 else b""

            def _answer(self, method: str) -> None:
                body = self._body()
                with stand_in._lock:
                    stand_in._state.requests.append(f"{which} {method} {self.path}")
                status, headers, out = stand_in._route(which, method, self.path, self.headers, body)
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def do_GET(self) -> None:
                self._answer("GET")

            def do_PUT(self) -> None:
                self._answer("PUT")

            def do_POST(self) -> None:
                self._answer("POST")

        return Handler

    def _route(
        self, which: str, method: str, target: str, headers: Any, body: bytes
    ) -> tuple[int, dict[str, str], bytes]:
        url = urlsplit(target)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        if which == "wire":
            if self.shape is not Shape.azure:
                return 404, {}, b""
            return self._wire(method, query, headers, body)
        if self.shape is Shape.gcp:
            return self._gcp(method, url.path, query, headers, body)
        return self._imds(method, url.path, query, headers)

    # GCP's metadata server --------------------------------------------------------------------

    def _gcp(
        self, method: str, path: str, query: dict[str, str], headers: Any, body: bytes
    ) -> tuple[int, dict[str, str], bytes]:
        flavor = {"Metadata-Flavor": "Google"}
        if not path.startswith("/computeMetadata/v1/"):
            return 404, flavor, b""
        if headers.get("Metadata-Flavor") != "Google" or headers.get("X-Forwarded-For"):
            return 403, {"Content-Type": "text/html"}, b"Missing Metadata-Flavor:Google header.\n"
        with self._lock:
            attributes = self._state.launch.gcp_metadata()
            boot = self._state.boot
        if method == "PUT" and path.startswith(GCP_GUEST_ATTRIBUTES):
            key = path.removeprefix(GCP_GUEST_ATTRIBUTES)
            if not re.fullmatch(r"[A-Za-z0-9_-]+/[A-Za-z0-9_-]+", key):
                return 400, flavor, b"guest attributes are NAMESPACE/KEY\n"
            value = body.decode(errors="replace")
            with self._lock:
                self._state.guest_attributes[key] = value
                if key == "umbra/ready":
                    self._state.ready.append(ReadyReport(Shape.gcp, boot, value))
                    self._lock.notify_all()
            return 200, flavor, b""
        if method != "GET":
            return 405, flavor, b""
        text = {"Content-Type": "application/text"} | flavor
        if path == GCP_ATTRIBUTES:
            if query.get("recursive") == "true":
                doc = json.dumps(attributes).encode()
                return 200, {"Content-Type": "application/json"} | flavor, doc
            return 200, text, "".join(f"{k}\n" for k in sorted(attributes)).encode()
        if path.startswith(GCP_ATTRIBUTES):
            one = attributes.get(path.removeprefix(GCP_ATTRIBUTES))
            return (404, flavor, b"") if one is None else (200, text, one.encode())
        if path == "/computeMetadata/v1/instance/id":
            numeric = int(hashlib.sha256(self.instance_id.encode()).hexdigest()[:15], 16)
            return 200, text, str(numeric).encode()
        if path == "/computeMetadata/v1/instance/name":
            return 200, text, self.instance_id.encode()
        return 404, flavor, b""

    # Azure's IMDS and wire server -------------------------------------------------------------

    def _imds(
        self, method: str, path: str, query: dict[str, str], headers: Any
    ) -> tuple[int, dict[str, str], bytes]:
        js = {"Content-Type": "application/json; charset=utf-8"}
        if not path.startswith("/metadata/"):
            return 404, js, b'{"error": "Not found"}'
        if headers.get("X-Forwarded-For"):
            return 403, js, b'{"error": "Forbidden: proxied requests are refused"}'
        if headers.get("Metadata") != "true":
            return 400, js, b'{"error": "Bad request. Required metadata header not specified"}'
        if "api-version" not in query:
            return 400, js, b'{"error": "Bad request. api-version was not specified"}'
        if method != "GET":
            return 405, js, b'{"error": "Method not allowed"}'
        with self._lock:
            user_data = self._state.launch.azure_user_data()
        if path == AZURE_USER_DATA:
            if query.get("format") != "text":
                return 400, js, b'{"error": "Bad request. Leaf nodes need format=text"}'
            return 200, {"Content-Type": "text/plain; charset=utf-8"}, user_data.encode()
        if path == "/metadata/instance":
            doc = {"compute": {"name": self.instance_id, "vmId": self.instance_id,
                               "userData": user_data}}  # fmt: skip
            return 200, js, json.dumps(doc).encode()
        return 404, js, b'{"error": "Not found"}'

    def _goal(self) -> tuple[str, str, str]:
        with self._lock:
            return str(self._state.boot), self._state.container_id, f"{self.instance_id}._0"

    def _wire(
        self, method: str, query: dict[str, str], headers: Any, body: bytes
    ) -> tuple[int, dict[str, str], bytes]:
        xml = {"Content-Type": "text/xml; charset=utf-8"}
        if headers.get("x-ms-version") != WIRE_VERSION:
            return 400, xml, b"<Error><Code>MissingHeader</Code></Error>"
        incarnation, container, instance = self._goal()
        if method == "GET" and query.get("comp") == "goalstate":
            return (
                200,
                xml,
                GOAL_STATE.format(inc=incarnation, cid=container, iid=instance).encode(),
            )
        if method == "POST" and query.get("comp") == "health":
            text = body.decode(errors="replace")

            def tag(name: str) -> str | None:
                m = re.search(f"<{name}>([^<]*)</{name}>", text)
                return None if m is None else m.group(1)

            got = (tag("GoalStateIncarnation"), tag("ContainerId"), tag("InstanceId"))
            if got != (incarnation, container, instance) or tag("State") != "Ready":
                return 400, xml, b"<Error><Code>InvalidHealthReport</Code></Error>"
            with self._lock:
                detail = f"{incarnation}/{container}/{instance}"
                self._state.ready.append(ReadyReport(Shape.azure, int(incarnation), detail))
                self._lock.notify_all()
            return 200, xml, b""
        return 404, xml, b""


GOAL_STATE = (
    '<?xml version="1.0" encoding="utf-8"?>\n<GoalState '
    'xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance">'
    f"<Version>{WIRE_VERSION}</Version><Incarnation>{{inc}}</Incarnation>"
    "<Machine><ExpectedState>Started</ExpectedState></Machine>"
    "<Container><ContainerId>{cid}</ContainerId><RoleInstanceList><RoleInstance>"
    "<InstanceId>{iid}</InstanceId><State>Started</State></RoleInstance>"
    "</RoleInstanceList></Container></GoalState>\n"
)
