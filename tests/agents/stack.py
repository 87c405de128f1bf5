"""A real proxy (`umbra proxy serve`) with the profiles, secrets and names a test chooses, in front
of loopback TLS origins that answer as those names (the test resolver maps each to 127.0.0.1)."""

from __future__ import annotations

import json
import ssl
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.proxy.harness import (
    ALICE_TOKEN,
    OriginServer,
    ProxyProcess,
    Recorder,
    TestCA,
    start_proxy,
)
from umbra.proxy.identity import hash_credential

CVM = "cvm-alice"


@dataclass
class Stack:
    workdir: Path
    ca: TestCA
    recorder: Recorder
    origin: OriginServer
    proxy: ProxyProcess

    @property
    def proxy_url(self) -> str:
        """The proxy with the CVM's credential, as clients that take a URL want it."""
        return self.proxy.url(ALICE_TOKEN, CVM)

    def stop(self) -> str:
        output = self.proxy.stop()
        self.origin.shutdown()
        return output


def start_stack(
    workdir: Path,
    names: Iterable[str],
    profiles: dict[str, str],
    attached: list[str],
    secrets: dict[str, Any] | None = None,
    before_proxy: Callable[[Path, Path], dict[str, str]] | None = None,
) -> Stack:
    """`profiles` maps a profile name to its YAML, where `{port}` stands for the origin's port.

    `before_proxy(cert, key)` may start origins of its own with the names' certificate; it returns
    more profiles (name to YAML) for them."""
    names = list(names)
    ca = TestCA(workdir)
    cert, key = ca.issue(names)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    recorder = Recorder()
    origin = OriginServer(recorder, tls).start()
    profiles = {name: text.replace("{port}", str(origin.port)) for name, text in profiles.items()}
    if before_proxy is not None:
        profiles |= before_proxy(cert, key)
    policies = workdir / "policies"
    policies.mkdir()
    for name, text in profiles.items():
        (policies / f"{name}.yaml").write_text(text)
    resolver = workdir / "resolver.json"
    resolver.write_text(json.dumps({name: ["127.0.0.1"] for name in names}))
    identities = workdir / "identities.json"
    identities.write_text(
        json.dumps(
            {
                "cvms": [
                    {
                        "cvm_id": CVM,
                        "owner": "alice",
                        "team": "acme",
                        "profiles": attached,
                        "credential_sha256": hash_credential(ALICE_TOKEN),
                    }
                ]
            }
        )
    )
    secrets_file = workdir / "secrets.json"
    secrets_file.write_text(json.dumps(secrets or {"team": {}}))
    secrets_file.chmod(0o600)
    proxy = start_proxy(
        [
            "--policy-dir", str(policies),
            "--identities", str(identities),
            "--secrets", str(secrets_file),
            "--upstream-ca", str(ca.cert_path),
            "--test-allow-upstream", "127.0.0.1/32",
            "--test-resolver", str(resolver),
        ],
        workdir,
    )  # fmt: skip
    return Stack(workdir, ca, recorder, origin, proxy)
