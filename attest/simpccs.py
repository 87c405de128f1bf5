"""A local PCCS serving the simulated PKI's collateral over HTTP on loopback.

It speaks the PCCS/PCS v4 API that `dcap_qvl.get_collateral` calls, so the embedded default and
the tests fetch simulated collateral through exactly the client production uses.
"""

from __future__ import annotations

import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType

from umbra.attest.collateral import Collateral
from umbra.attest.simpki import SIM_FMSPC, SimulatedPki


class SimulatedPccs:
    """Context manager: `with SimulatedPccs(pki, issued_at) as pccs: pccs.url`."""

    def __init__(
        self,
        pki: SimulatedPki | None,
        issued_at: int = 0,
        host: str = "127.0.0.1",
        *,
        collateral: Collateral | None = None,
        port: int = 0,
    ) -> None:
        """Serve `pki`'s collateral issued at `issued_at`, or a recorded `collateral` set (a
        stand-in for Intel PCS in tests of the fetch path with real quotes)."""
        if collateral is None:
            if pki is None:
                raise ValueError("give a simulated PKI or a recorded collateral set")
            collateral = pki.collateral(issued_at)
        self.collateral: Collateral = collateral
        fmspc = (collateral.fmspc or SIM_FMSPC.hex()).upper()
        self.requests: list[str] = []
        doc = json.loads(self.collateral.json_text)
        routes = _routes(doc)
        log = self.requests

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                log.append(self.path)
                parsed = urllib.parse.urlsplit(self.path)
                query = urllib.parse.parse_qs(parsed.query)
                route = routes.get(parsed.path)
                if route is None or (
                    parsed.path.endswith("/tcb") and query.get("fmspc", [""])[0].upper() != fmspc
                ):
                    self.send_error(404)
                    return
                body, headers = route
                self.send_response(200)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass  # requests are recorded in `requests`, not printed

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def __enter__(self) -> SimulatedPccs:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def _routes(doc: dict[str, str]) -> dict[str, tuple[bytes, dict[str, str]]]:
    def chain(pem: str) -> str:
        return urllib.parse.quote(pem, safe="")

    tcb = (
        f'{{"tcbInfo":{doc["tcb_info"]},"signature":"{doc["tcb_info_signature"]}"}}'.encode(),
        {
            "TCB-Info-Issuer-Chain": chain(doc["tcb_info_issuer_chain"]),
            "Content-Type": "application/json",
        },
    )
    qe = (
        f'{{"enclaveIdentity":{doc["qe_identity"]},'
        f'"signature":"{doc["qe_identity_signature"]}"}}'.encode(),
        {
            "SGX-Enclave-Identity-Issuer-Chain": chain(doc["qe_identity_issuer_chain"]),
            "Content-Type": "application/json",
        },
    )
    pck_crl = (
        bytes.fromhex(doc["pck_crl"]),
        {
            "SGX-PCK-CRL-Issuer-Chain": chain(doc["pck_crl_issuer_chain"]),
            "Content-Type": "application/pkix-crl",
        },
    )
    root_crl = (doc["root_ca_crl"].encode(), {"Content-Type": "text/plain"})
    out: dict[str, tuple[bytes, dict[str, str]]] = {}
    for kind in ("sgx", "tdx"):
        base = f"/{kind}/certification/v4"
        out[f"{base}/tcb"] = tcb
        out[f"{base}/qe/identity"] = qe
        out[f"{base}/pckcrl"] = pck_crl
        out[f"{base}/rootcacrl"] = root_crl
    return out
