"""Added latency of credentials the proxy makes, side by side in one run of one proxy: a static
secret (the baseline), an access token minted from client credentials on a warm cache, and an
AWS SigV4 re-sign; then the two operations alone, in process.

Run: .venv/bin/python benchmarks/credentials_bench.py [--requests 1000] [--rounds 10]

Each path is one keep-alive HTTP/1.1 connection through the proxy's CONNECT tunnel to the same
loopback TLS origin; the paths take turns in rounds (so drift hits all alike). Reported: p50 and
p99 per path and each path's p50 over the static baseline. The target (issue 25): a minted token
on a warm cache within 1 ms of a static secret.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mitmproxy.http import Headers

from tests.proxy.harness import (
    OriginServer,
    Recorder,
    TestCA,
    auth_header,
    read_response,
    start_proxy,
    status_of,
    write_identities,
)
from tests.proxy.token_endpoint import TokenEndpoint
from umbra.contracts.secret_kinds import AwsSigv4, OAuth2ClientCredentials
from umbra.proxy.minting import Minted, Minter
from umbra.proxy.netcheck import AddressPolicy
from umbra.proxy.resolver import StaticResolver
from umbra.proxy.secrets import Material
from umbra.proxy.sigv4 import resign
from umbra.proxy.token_dialer import TokenDialer

HOSTS = ["static.test", "minted.test", "aws.test", "auth.test"]
PLACEHOLDER_AUTH = (
    "AWS4-HMAC-SHA256 Credential=UMBRAPLACEHOLDER/20260101/us-east-1/s3/aws4_request, "
    "SignedHeaders=host;x-amz-content-sha256;x-amz-date, Signature=" + "0" * 64
)


def setup(workdir: Path) -> tuple[OriginServer, TokenEndpoint, TestCA, object]:
    ca = TestCA(workdir)
    cert, key = ca.issue(HOSTS)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    origin = OriginServer(Recorder(), tls).start()
    origin.recorder.add = lambda item: None  # type: ignore[method-assign]
    port = origin.port
    endpoint = TokenEndpoint(f"https://auth.test:{port}/token")
    endpoint.register_client("bench", "bench-client-secret-7a1c")
    origin.routes["auth.test"] = endpoint.handle
    policies = workdir / "policies"
    policies.mkdir()
    target = f"ports: [{port}]"
    (policies / "bench.yaml").write_text(
        "apiVersion: umbra/v1\nkind: Profile\nname: testing\negress:\n"
        f"  - allow: {{hosts: [static.test, minted.test, aws.test], {target}}}\n"
        "inject:\n"
        "  - {id: static, header: Authorization, format: 'Bearer {secret}', secret: team/static,"
        f" hosts: [static.test], {target}}}\n"
        "  - {id: minted, header: Authorization, format: 'Bearer {secret}', secret: team/minted,"
        f" hosts: [minted.test], {target}}}\n"
        "  - {id: aws, sigv4: {services: [s3], regions: [us-east-1]}, secret: team/aws,"
        f" hosts: [aws.test], {target}}}\n"
    )
    resolver = workdir / "resolver.json"
    resolver.write_text(json.dumps({name: ["127.0.0.1"] for name in HOSTS}))
    identities = workdir / "identities.json"
    write_identities(identities)
    secrets = workdir / "secrets.json"
    team = {
        "static": "static-secret-value-3f9e1b7c5d2a",
        "minted": {
            "kind": "oauth2-client-credentials",
            "token_url": endpoint.token_url,
            "client_id": "bench",
            "client_secret": "bench-client-secret-7a1c",
        },
        "aws": {
            "kind": "aws-sigv4",
            "access_key_id": "AKIAREALKEY000000001",
            "secret_access_key": "real-secret-access-key-for-the-bench",
        },
    }
    secrets.write_text(json.dumps({"team": team}))
    secrets.chmod(0o600)
    proxy = start_proxy(
        ["--policy-dir", str(policies), "--identities", str(identities),
         "--secrets", str(secrets), "--upstream-ca", str(ca.cert_path),
         "--test-allow-upstream", "127.0.0.1/32", "--test-resolver", str(resolver)],
        workdir,
    )  # fmt: skip
    return origin, endpoint, ca, proxy


def open_path(proxy_port: int, host: str, origin_port: int, cafile: Path) -> ssl.SSLSocket:
    import socket

    sock = socket.create_connection(("127.0.0.1", proxy_port), timeout=30)
    target = f"{host}:{origin_port}"
    sock.sendall(
        f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n"
        f"Proxy-Authorization: {auth_header()}\r\n\r\n".encode()
    )
    if status_of(read_response(sock)) != 200:
        raise RuntimeError(f"CONNECT {host} refused")
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    context = ssl.create_default_context(cafile=str(cafile))
    return context.wrap_socket(sock, server_hostname=host)


def request(sock: ssl.SSLSocket, host: str, port: int) -> None:
    extra = ""
    if host == "aws.test":
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        extra = (
            f"Authorization: {PLACEHOLDER_AUTH}\r\nX-Amz-Date: {stamp}\r\n"
            "X-Amz-Content-SHA256: UNSIGNED-PAYLOAD\r\n"
        )
    sock.sendall(f"GET /bench HTTP/1.1\r\nHost: {host}:{port}\r\n{extra}\r\n".encode())
    response = read_response(sock)
    if status_of(response) != 200:
        raise RuntimeError(f"{host}: {response[:300]!r}")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def in_process(n: int) -> dict[str, float]:
    """The two operations alone: a warm-cache token lookup and one SigV4 re-sign (µs)."""
    material = Material(
        OAuth2ClientCredentials(
            kind="oauth2-client-credentials",
            token_url="https://auth.test/token",  # noqa: S106 (a URL)
            client_id="c",
            client_secret="s",  # noqa: S106 (a stand-in)
        ),
        1,
    )
    minter = Minter(TokenDialer(StaticResolver({}), AddressPolicy))
    key = ("team/minted", None)
    minter._entry(key, material)[0].minted = Minted("tok", time.time() + 3600, time.time() + 3000)

    async def warm() -> float:
        start = time.perf_counter()
        for _ in range(n):
            await minter.token(key, material)
        return (time.perf_counter() - start) / n * 1e6

    warm_us = asyncio.run(warm())
    secret = AwsSigv4(
        kind="aws-sigv4", access_key_id="AKIAREALKEY000000001", secret_access_key="x" * 40
    )
    start = time.perf_counter()
    for _ in range(n):
        headers = Headers(
            [
                (b"Authorization", PLACEHOLDER_AUTH.encode()),
                (b"X-Amz-Date", b"20260101T000000Z"),
                (b"X-Amz-Content-SHA256", b"UNSIGNED-PAYLOAD"),
            ]
        )
        resign(method="GET", path="/bucket/key?list-type=2", host="aws.test", headers=headers,
               body=b"", secret=secret, services=["s3"], regions=["us-east-1"])  # fmt: skip
    sign_us = (time.perf_counter() - start) / n * 1e6
    return {"warm_token_lookup_us": warm_us, "sigv4_resign_us": sign_us}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="creds-bench-") as tmp:
        workdir = Path(tmp)
        origin, endpoint, _ca, proxy = setup(workdir)
        try:
            port = origin.port
            paths = {"static": "static.test", "minted (warm)": "minted.test", "sigv4": "aws.test"}
            socks = {
                name: open_path(proxy.port, host, port, proxy.ca)  # type: ignore[attr-defined]
                for name, host in paths.items()
            }
            for name, host in paths.items():  # warm: TLS, the minted token, caches
                for _ in range(50):
                    request(socks[name], host, port)
            timings: dict[str, list[float]] = {name: [] for name in paths}
            per_round = max(1, args.requests // args.rounds)
            for _ in range(args.rounds):
                for name, host in paths.items():
                    sock = socks[name]
                    for _ in range(per_round):
                        start = time.perf_counter()
                        request(sock, host, port)
                        timings[name].append(time.perf_counter() - start)
            for sock in socks.values():
                sock.close()
            mints = endpoint.calls.get("client_credentials", 0)
        finally:
            proxy.stop()  # type: ignore[attr-defined]
            origin.shutdown()
    base = statistics.median(timings["static"])
    results: dict[str, object] = {
        name: {
            "p50_ms": round(statistics.median(values) * 1e3, 3),
            "p99_ms": round(percentile(values, 0.99) * 1e3, 3),
            "added_p50_ms_vs_static": round((statistics.median(values) - base) * 1e3, 3),
            "ratio_p50_vs_static": round(statistics.median(values) / base, 3),
        }
        for name, values in timings.items()
    }
    results["token_endpoint_calls"] = mints
    results["in_process"] = {k: round(v, 2) for k, v in in_process(20000).items()}
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
