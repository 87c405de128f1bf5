"""Minted credentials through the real proxy: access tokens from client credentials, a Google
service-account key (JWT bearer) and a rotating refresh token (ChatGPT-style: every refresh voids
the last), injected as `Authorization: Bearer`. The token endpoint and the APIs are local stand-ins
that check what they receive; no secret field or minted token reaches the sandbox, a record or the
proxy's output. A refused refresh answers 403 `credential_refresh_failed` once per request without
another call to the endpoint; a slow endpoint is waited on, bounded, without stalling other flows."""

from __future__ import annotations

import base64
import json
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from tests.proxy.harness import (
    ALICE_TOKEN,
    OriginHandler,
    OriginServer,
    ProxyProcess,
    Recorder,
    Seen,
    TestCA,
    curl,
    curl_status,
    start_proxy,
    write_identities,
)
from tests.proxy.token_endpoint import GitHubAppEndpoint, TokenEndpoint

CC_SECRET = "cc-secret-5b1e0f7a9d3c2e84"
SA_EMAIL = "robot@proj.iam.gserviceaccount.com"
API_HOSTS = ["cc.test", "gsa.test", "codex.test", "slow.test", "free.test", "internal-api.test"]
# A GitHub App: the token exchange and the API on one host (as api.github.com), git over HTTPS on
# another (as github.com), an installation GitHub does not know and a key that is not the app's.
GITHUB_HOSTS = ["ghapp.test", "gitgh.test", "ghapp-bad.test", "ghapp-forged.test"]
APP_ID, INSTALLATION = 123456, 7890123
AUTH_HOSTS = ["auth.test", "codex-auth.test", "slow-auth.test", "internal-auth.test"]


@dataclass
class MintEnv:
    workdir: Path
    recorder: Recorder
    origin: OriginServer
    proxy: ProxyProcess
    auth: TokenEndpoint
    codex: TokenEndpoint
    slow: TokenEndpoint
    private_pem: str
    first_refresh: str
    github: GitHubAppEndpoint
    app_pem: str


def _api(endpoints: list[TokenEndpoint]) -> object:
    """An API that answers 200 only to a Bearer one of the endpoints issued and still valid."""

    def route(handler: OriginHandler, seen: Seen) -> None:
        auth = " ".join(seen.header("authorization"))
        token = auth.removeprefix("Bearer ")
        ok = auth.startswith("Bearer ") and any(e.valid(token) for e in endpoints)
        handler.send(200 if ok else 401, b"api ok\n" if ok else b"bad token\n")

    return route


def policy(port: int) -> str:
    target = f"ports: [{port}]"
    rules = [
        ("cc", "team/cc", "cc.test"),
        ("gsa", "team/gsa", "gsa.test"),
        ("codex", "personal/codex", "codex.test"),
        ("slow", "team/slow", "slow.test"),
        ("internal", "team/internal", "internal-api.test"),
        ("ghapp", "team/ghapp", "ghapp.test"),
        ("ghapp-bad", "team/ghapp-bad", "ghapp-bad.test"),
        ("ghapp-forged", "team/ghapp-forged", "ghapp-forged.test"),
    ]
    inject = "\n".join(
        f'  - {{id: {rid}, header: Authorization, format: "Bearer {{secret}}", secret: {ref}, '
        f"hosts: [{host}], {target}}}"
        for rid, ref, host in rules
    )
    inject += (
        '\n  - {id: ghgit, header: Authorization, format: "Basic {basic:x-access-token}", '
        f"secret: team/ghapp, hosts: [gitgh.test], {target}}}"
    )
    return f"""
apiVersion: umbra/v1
kind: Profile
name: testing
egress:
  - id: api
    allow: {{hosts: [{", ".join(API_HOSTS + GITHUB_HOSTS)}], {target}}}
inject:
{inject}
"""


@pytest.fixture(scope="module")
def menv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MintEnv]:
    workdir = tmp_path_factory.mktemp("minting")
    ca = TestCA(workdir)
    cert, key = ca.issue(API_HOSTS + AUTH_HOSTS + GITHUB_HOSTS)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    recorder = Recorder()
    origin = OriginServer(recorder, tls).start()
    port = origin.port
    auth = TokenEndpoint(f"https://auth.test:{port}/token")
    codex = TokenEndpoint(f"https://codex-auth.test:{port}/token", expires_in=2)
    slow = TokenEndpoint(f"https://slow-auth.test:{port}/token")
    slow.delay = 30.0
    auth.register_client("cc-client", CC_SECRET)
    slow.register_client("cc-client", CC_SECRET)
    account = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    auth.register_account(SA_EMAIL, account.public_key())
    private_pem = account.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    first_refresh = codex.start_chain("codex-cli")
    origin.routes |= {
        "auth.test": auth.handle,
        "codex-auth.test": codex.handle,
        "slow-auth.test": slow.handle,
    }
    for host in API_HOSTS:
        origin.routes[host] = _api([auth, codex, slow])  # type: ignore[assignment]
    github = GitHubAppEndpoint()
    app_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    github.register(APP_ID, INSTALLATION, app_key.public_key())
    app_pem = app_key.private_bytes(  # PKCS#1, as GitHub's download is
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    ).decode()
    for host in GITHUB_HOSTS:
        origin.routes[host] = github.handle
    policy_dir = workdir / "policies"
    policy_dir.mkdir()
    (policy_dir / "testing.yaml").write_text(policy(port))
    resolver = workdir / "resolver.json"
    answers = {name: ["127.0.0.1"] for name in API_HOSTS + AUTH_HOSTS + GITHUB_HOSTS}
    resolver.write_text(json.dumps(answers | {"internal-auth.test": ["10.0.0.9"]}))
    identities = workdir / "identities.json"
    write_identities(identities)
    cc = {
        "kind": "oauth2-client-credentials",
        "token_url": auth.token_url,
        "client_id": "cc-client",
        "client_secret": CC_SECRET,
    }
    app: dict[str, object] = {
        "kind": "github-app",
        "app_id": APP_ID,
        "installation_id": INSTALLATION,
        "private_key": app_pem,
        "api_url": f"https://ghapp.test:{port}",
    }
    team = {
        "cc": cc,
        "slow": cc | {"token_url": slow.token_url},
        "internal": cc | {"token_url": f"https://internal-auth.test:{port}/token"},
        "gsa": {
            "kind": "google-service-account",
            "client_email": SA_EMAIL,
            "private_key": private_pem,
            "token_uri": auth.token_url,
            "scopes": ["https://www.googleapis.com/auth/cloud-platform"],
        },
        "ghapp": app,
        "ghapp-bad": app | {"installation_id": INSTALLATION + 1},
    }
    other_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    team["ghapp-forged"] = app | {
        "private_key": other_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ).decode()
    }
    codex_doc = {
        "kind": "oauth2-refresh",
        "token_url": codex.token_url,
        "client_id": "codex-cli",
        "refresh_token": first_refresh,
    }
    secrets = workdir / "secrets.json"
    secrets.write_text(json.dumps({"team": team, "personal": {"alice": {"codex": codex_doc}}}))
    secrets.chmod(0o600)
    proxy = start_proxy(
        [
            *("--policy-dir", str(policy_dir), "--identities", str(identities)),
            *("--secrets", str(secrets), "--upstream-ca", str(ca.cert_path)),
            *("--test-allow-upstream", "127.0.0.1/32", "--test-resolver", str(resolver)),
        ],
        workdir,
    )
    env = MintEnv(
        workdir, recorder, origin, proxy, auth, codex, slow, private_pem, first_refresh, github,
        app_pem,
    )  # fmt: skip
    yield env
    output = proxy.stop().encode()
    origin.shutdown()
    spool = b"".join(p.read_bytes() for p in (workdir / "spool").glob("*.jsonl"))
    for name, form in forms(env).items():
        assert form not in output, f"{name} appeared in the proxy's output"
        assert form not in spool, f"{name} appeared in the traffic log"


def forms(env: MintEnv) -> dict[str, bytes]:
    """Every secret field and every token the endpoints minted or rotated."""
    key_body = "".join(env.private_pem.splitlines()[1:4])
    values = {"client secret": CC_SECRET, "private key": key_body, "refresh": env.first_refresh}
    values |= {f"app key line {i}": line for i, line in enumerate(env.app_pem.splitlines()[1:-1])}
    values |= {f"installation token {t[:8]}": t for t in env.github.issued}
    for endpoint in (env.auth, env.codex, env.slow):
        values |= {f"token {t[:8]}": t for t in endpoint.issued}
        values |= {f"spent {t[:8]}": t for t in endpoint.spent}
        values |= {f"chain {k}": t for k, t in endpoint.current_refresh.items()}
    return {name: value.encode() for name, value in values.items()}


def get(env: MintEnv, host: str, path: str = "/v1/thing") -> tuple[int, str]:
    result = curl(env.proxy, f"https://{host}:{env.origin.port}{path}", "-i")
    return curl_status(result), result.stdout


def sandbox_saw_nothing(env: MintEnv, text: str) -> None:
    for name, form in forms(env).items():
        assert form.decode() not in text, f"{name} reached the sandbox"


def test_client_credentials_are_minted_once_and_injected(menv: MintEnv) -> None:
    first = get(menv, "cc.test", "/cc-1")
    second = get(menv, "cc.test", "/cc-2")
    assert first[0] == 200 and second[0] == 200, first[1]
    assert menv.auth.calls.get("client_credentials") == 1  # the second came from the cache
    seen = [s for s in menv.recorder.snapshot() if s.path in ("/cc-1", "/cc-2")]
    tokens = {s.header("authorization")[0] for s in seen}
    assert len(tokens) == 1 and menv.auth.valid(tokens.pop().removeprefix("Bearer "))
    sandbox_saw_nothing(menv, first[1] + second[1])


def test_google_service_account_mints_by_jwt_bearer(menv: MintEnv) -> None:
    status, text = get(menv, "gsa.test", "/gsa")
    assert status == 200, text
    assert menv.auth.calls.get("urn:ietf:params:oauth:grant-type:jwt-bearer") == 1
    sandbox_saw_nothing(menv, text)


def test_a_github_app_installation_token_is_minted_and_injected(menv: MintEnv) -> None:
    """The app's JWT is verified by the stand-in with the app's public key; the installation token
    it returns reaches the API as a Bearer and git as `Basic x-access-token:<token>`, minted once
    for both (one secret, one cache)."""
    api = get(menv, "ghapp.test", "/repos/acme/widgets")
    git = get(menv, "gitgh.test", "/acme/widgets.git/info/refs")
    again = get(menv, "ghapp.test", "/repos/acme/widgets/pulls")
    assert api[0] == 200 and git[0] == 200 and again[0] == 200, api[1] + git[1]
    assert menv.github.exchanges == 1 and menv.github.refused == 0
    assert menv.github.headers[0]["accept"] == "application/vnd.github+json"
    paths = ("/repos/acme/widgets", "/repos/acme/widgets/pulls", "/acme/widgets.git/info/refs")
    seen = {
        s.path: s.header("authorization")[0] for s in menv.recorder.snapshot() if s.path in paths
    }
    token = seen["/repos/acme/widgets"].removeprefix("Bearer ")
    assert token.startswith("ghs_") and menv.github.valid(token)
    assert seen["/repos/acme/widgets/pulls"] == f"Bearer {token}"
    assert base64.b64decode(seen["/acme/widgets.git/info/refs"][6:]).decode() == (
        f"x-access-token:{token}"
    )
    sandbox_saw_nothing(menv, api[1] + git[1] + again[1])


@pytest.mark.parametrize("host", ["ghapp-bad.test", "ghapp-forged.test"])
def test_a_refused_github_app_mint_is_403(menv: MintEnv, host: str) -> None:
    """GitHub answers 404 for an installation the app does not have and 401 for a JWT its key
    does not verify: a refusal, recorded, never retried, and the API is never reached."""
    mark = menv.proxy.log.mark()
    status, text = get(menv, host, "/repos/acme/bad")
    assert status == 403 and "credential_refresh_failed" in text, text
    record = menv.proxy.log.wait_for(mark, lambda r: r.get("path") == "/repos/acme/bad")
    assert record["reason"] == "credential_refresh_failed" and record["decision"] == "deny"
    refused = menv.github.refused
    assert get(menv, host, "/repos/acme/bad-again")[0] == 403
    assert menv.github.refused == refused  # remembered for this version: no second call
    assert not any(s.path.startswith("/repos/acme/bad") for s in menv.recorder.snapshot())
    sandbox_saw_nothing(menv, text)


def test_a_rotating_refresh_token_keeps_one_chain(menv: MintEnv) -> None:
    """Tokens live 2 s here; every refresh rotates the refresh token. Requests across several
    lifetimes all succeed, and the endpoint never sees a spent token (a reuse would revoke)."""
    for index in range(4):
        status, text = get(menv, "codex.test", f"/codex-{index}")
        assert status == 200, text
        sandbox_saw_nothing(menv, text)
        time.sleep(1.1)
    assert menv.codex.calls["refresh_token"] >= 2
    assert menv.codex.refused == 0 and menv.codex.chain("codex-cli") is not None


def test_a_refused_refresh_is_403_and_never_retried(menv: MintEnv) -> None:
    menv.codex.revoke("codex-cli")  # e.g. the user logged out elsewhere
    time.sleep(2.1)  # the last access token expires
    mark = menv.proxy.log.mark()
    status, text = get(menv, "codex.test", "/codex-refused")
    assert status == 403 and "credential_refresh_failed" in text, text
    record = menv.proxy.log.wait_for(mark, lambda r: r.get("path") == "/codex-refused")
    assert record["reason"] == "credential_refresh_failed" and record["decision"] == "deny"
    calls = menv.codex.calls["refresh_token"]
    for index in range(5):
        assert get(menv, "codex.test", f"/codex-again-{index}")[0] == 403
    assert menv.codex.calls["refresh_token"] == calls  # no retry storm
    assert not any(s.path.startswith("/codex-again") for s in menv.recorder.snapshot())


def test_a_token_endpoint_on_a_private_address_is_refused(menv: MintEnv) -> None:
    status, text = get(menv, "internal-api.test", "/internal")
    assert status == 403 and "credential_refresh_failed" in text, text


def test_a_slow_token_endpoint_is_bounded_and_stalls_no_other_flow(menv: MintEnv) -> None:
    get(menv, "cc.test", "/warm")  # warm
    result: dict[str, Any] = {}

    def slow() -> None:
        started = time.monotonic()
        result["answer"] = get(menv, "slow.test", "/slow")
        result["took"] = time.monotonic() - started

    thread = threading.Thread(target=slow)
    thread.start()
    time.sleep(0.5)
    for index in range(3):  # meanwhile, other flows go through at once
        started = time.monotonic()
        assert get(menv, "cc.test", f"/during-{index}")[0] == 200
        assert get(menv, "free.test", f"/free-{index}")[0] in (200, 401)
        assert time.monotonic() - started < 3
    thread.join(30)
    status, text = result["answer"]
    assert status == 503 and "credential_unavailable" in text, text
    assert 7 <= float(result["took"]) < 13
    # Held after the failure: the next request is refused at once, not after another wait.
    started = time.monotonic()
    assert get(menv, "slow.test", "/slow-again")[0] == 503
    assert time.monotonic() - started < 3


def test_google_client_library_behind_the_proxy(menv: MintEnv) -> None:
    """google-auth: its own service-account refresh is accepted by the stand-in (the assertion
    shape the proxy also sends), and a client holding only a placeholder token, through the proxy,
    reaches the API with a token minted on the Security CVM."""
    import requests
    from google.auth.transport.requests import AuthorizedSession, Request
    from google.oauth2 import credentials as user_credentials
    from google.oauth2 import service_account

    port = menv.origin.port
    direct = TokenEndpoint(f"https://127.0.0.1:{port}/token")
    direct.register_account(SA_EMAIL, menv.auth.accounts[SA_EMAIL])
    menv.origin.routes["127.0.0.1"] = direct.handle
    info = {
        "type": "service_account",
        "client_email": SA_EMAIL,
        "private_key": menv.private_pem,
        "private_key_id": "k1",
        "token_uri": direct.token_url,
    }
    library = service_account.Credentials.from_service_account_info(  # type: ignore[no-untyped-call]
        info, scopes=["https://www.googleapis.com/auth/cloud-platform"]
    )
    session = requests.Session()
    session.trust_env = False  # the machine's REQUESTS_CA_BUNDLE would override `verify`
    session.verify = str(menv.workdir / "origin-ca.pem")
    library.refresh(Request(session))
    assert library.token and direct.valid(library.token)

    # The sandbox's side: a placeholder, never a key; the proxy swaps in its minted token.
    placeholder = user_credentials.Credentials(token="umbra-placeholder:team/gsa")  # type: ignore[no-untyped-call]
    sandbox = AuthorizedSession(placeholder)  # type: ignore[no-untyped-call]
    sandbox.trust_env = False
    sandbox.proxies = {"https": f"http://cvm-alice:{ALICE_TOKEN}@127.0.0.1:{menv.proxy.port}"}
    sandbox.verify = str(menv.proxy.ca)
    answer = sandbox.get(f"https://gsa.test:{port}/v1/projects/p/models")
    assert answer.status_code == 200, answer.text
    sandbox_saw_nothing(menv, answer.text + str(dict(answer.headers)))


def test_concurrent_requests_for_a_cold_secret_make_one_call(tmp_path: Path) -> None:
    """Single flight: twenty concurrent requests for one cold secret share one call to a slow
    token endpoint (real TLS on loopback, dialled through the proxy's resolver and address
    policy); a request for another secret does not wait for it."""
    import asyncio
    import ipaddress

    from umbra.contracts.secret_kinds import OAuth2ClientCredentials
    from umbra.proxy.minting import Minter
    from umbra.proxy.netcheck import AddressPolicy
    from umbra.proxy.resolver import StaticResolver
    from umbra.proxy.secrets import Material
    from umbra.proxy.token_dialer import TokenDialer

    ca = TestCA(tmp_path)
    cert, key = ca.issue(["burst.test", "quick.test"])
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    origin = OriginServer(Recorder(), tls).start()
    slow = TokenEndpoint(f"https://burst.test:{origin.port}/token")
    quick = TokenEndpoint(f"https://quick.test:{origin.port}/token")
    slow.delay = 1.0
    for endpoint in (slow, quick):
        endpoint.register_client("c", CC_SECRET)
    origin.routes |= {"burst.test": slow.handle, "quick.test": quick.handle}

    def material(url: str) -> Material:
        document = OAuth2ClientCredentials(
            kind="oauth2-client-credentials", token_url=url, client_id="c", client_secret=CC_SECRET
        )
        return Material(document, 1)

    policy = AddressPolicy(test_allow=(ipaddress.ip_network("127.0.0.1/32"),))
    resolver = StaticResolver({"burst.test": ["127.0.0.1"], "quick.test": ["127.0.0.1"]})

    async def run() -> tuple[set[str], float]:
        context = ssl.create_default_context(cafile=str(ca.cert_path))
        minter = Minter(TokenDialer(resolver, lambda: policy, context))
        burst = [
            asyncio.create_task(minter.token(("team/burst", None), material(slow.token_url)))
            for _ in range(20)
        ]
        await asyncio.sleep(0.1)
        started = time.monotonic()
        await minter.token(("team/quick", None), material(quick.token_url))
        other = time.monotonic() - started
        return set(await asyncio.gather(*burst)), other

    try:
        tokens, other = asyncio.run(run())
    finally:
        origin.shutdown()
    assert len(tokens) == 1 and slow.valid(tokens.pop())
    assert slow.calls["client_credentials"] == 1
    assert other < 0.8  # the other secret's mint did not queue behind the slow one
