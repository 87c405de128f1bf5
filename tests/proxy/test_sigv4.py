"""AWS SigV4 re-signing through the real proxy, with the real AWS CLI (`awscli` from PyPI) in the
sandbox's place holding placeholder keys, against a local S3/STS-style origin that verifies every
signature with the real key using botocore's own signer. Header and presigned forms, a body hash
(STS), unsigned trailer uploads (S3), a region or service the rule does not name, an unsigned
request; the real secret key reaches no output, record or wire."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import ssl
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest
from mitmproxy.http import Headers

from tests.proxy.aws_origin import AwsOrigin
from tests.proxy.harness import (
    ALICE_TOKEN,
    OriginServer,
    ProxyProcess,
    Recorder,
    TestCA,
    curl,
    curl_status,
    start_proxy,
    write_identities,
)
from umbra.contracts.secret_kinds import AwsSigv4
from umbra.proxy.sigv4 import Scope, Sigv4Error, chunk_string_to_sign, resign, signing_key

REAL_KEY_ID = "AKIAREALKEY000000001"
REAL_SECRET = "real/secret+KEY/4b7e1c9a0f3d5e8a2b6c"
HOSTS = ["s3.test", "sts.test"]
AWS = Path(os.environ.get("UMBRA_VENV", ".venv")) / "bin" / "aws"


@dataclass
class AwsEnv:
    workdir: Path
    origin: OriginServer
    aws: AwsOrigin
    proxy: ProxyProcess
    env: dict[str, str]


def policy(port: int) -> str:
    return f"""
apiVersion: umbra/v1
kind: Profile
name: testing
egress:
  - id: aws
    allow: {{hosts: [s3.test, sts.test], ports: [{port}]}}
inject:
  - {{id: s3, sigv4: {{services: [s3], regions: [us-east-1]}}, secret: team/aws, hosts: [s3.test], ports: [{port}]}}
  - {{id: sts, sigv4: {{services: [sts], regions: [us-east-1]}}, secret: team/aws, hosts: [sts.test], ports: [{port}]}}
"""


@pytest.fixture(scope="module")
def awsenv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AwsEnv]:
    if not AWS.exists():
        pytest.fail(f"{AWS}: the AWS CLI (dev dependency awscli) is not installed")
    workdir = tmp_path_factory.mktemp("sigv4")
    ca = TestCA(workdir)
    cert, key = ca.issue(HOSTS)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    origin = OriginServer(Recorder(), tls).start()
    aws = AwsOrigin(REAL_KEY_ID, REAL_SECRET)
    origin.routes |= {"s3.test": aws.s3, "sts.test": aws.sts}
    policy_dir = workdir / "policies"
    policy_dir.mkdir()
    (policy_dir / "testing.yaml").write_text(policy(origin.port))
    resolver = workdir / "resolver.json"
    resolver.write_text(json.dumps({name: ["127.0.0.1"] for name in HOSTS}))
    identities = workdir / "identities.json"
    write_identities(identities)
    secrets = workdir / "secrets.json"
    document = {"kind": "aws-sigv4", "access_key_id": REAL_KEY_ID, "secret_access_key": REAL_SECRET}
    secrets.write_text(json.dumps({"team": {"aws": document}}))
    secrets.chmod(0o600)
    proxy = start_proxy(
        [
            *("--policy-dir", str(policy_dir), "--identities", str(identities)),
            *("--secrets", str(secrets), "--upstream-ca", str(ca.cert_path)),
            *("--test-allow-upstream", "127.0.0.1/32", "--test-resolver", str(resolver)),
        ],
        workdir,
    )
    config = workdir / "aws-config"
    config.write_text(
        "[default]\nregion = us-east-1\ns3 =\n  addressing_style = path\n"
        "  signature_version = s3v4\n"
    )
    # What a sandbox holds: placeholders only, and the proxy as its only way out.
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(workdir),
        "AWS_ACCESS_KEY_ID": "UMBRAPLACEHOLDER",
        "AWS_SECRET_ACCESS_KEY": "umbra-placeholder",
        "AWS_CONFIG_FILE": str(config),
        "AWS_SHARED_CREDENTIALS_FILE": str(workdir / "none"),
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CA_BUNDLE": str(proxy.ca),
        "HTTPS_PROXY": f"http://cvm-alice:{ALICE_TOKEN}@127.0.0.1:{proxy.port}",
        "NO_PROXY": "",
    }
    yield AwsEnv(workdir, origin, aws, proxy, env)
    output = proxy.stop()
    origin.shutdown()
    spool = b"".join(p.read_bytes() for p in (workdir / "spool").glob("*.jsonl"))
    assert REAL_SECRET not in output and REAL_SECRET.encode() not in spool
    assert not origin.recorder.contains(REAL_SECRET.encode())  # the key itself is never sent


def aws(env: AwsEnv, *args: str, host: str = "s3.test") -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [str(AWS), *args, "--endpoint-url", f"https://{host}:{env.origin.port}"],
        env=env.env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert REAL_SECRET not in result.stdout + result.stderr
    return result


def test_the_aws_cli_lists_puts_and_gets_through_the_re_signing_proxy(awsenv: AwsEnv) -> None:
    listed = aws(awsenv, "s3api", "list-buckets")
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout)["Buckets"][0]["Name"] == "bucket"
    payload = awsenv.workdir / "hello.txt"
    payload.write_bytes(b"hello from the sandbox\n" * 100)
    put = aws(awsenv, "s3api", "put-object", "--bucket", "bucket", "--key", "hello.txt",
              "--body", str(payload))  # fmt: skip
    assert put.returncode == 0, put.stderr
    assert awsenv.aws.objects["/bucket/hello.txt"] == payload.read_bytes()
    out = awsenv.workdir / "got.txt"
    got = aws(awsenv, "s3api", "get-object", "--bucket", "bucket", "--key", "hello.txt", str(out))
    assert got.returncode == 0, got.stderr
    assert out.read_bytes() == payload.read_bytes()
    copied = aws(awsenv, "s3", "cp", str(payload), "s3://bucket/copied.txt")
    assert copied.returncode == 0, copied.stderr
    assert awsenv.aws.objects["/bucket/copied.txt"] == payload.read_bytes()
    # Every request the origin saw was signed with the real key; none with the placeholder.
    assert awsenv.aws.refused == []
    assert all("UMBRAPLACEHOLDER" not in auth for auth in awsenv.aws.seen_auth)


def test_a_non_s3_service_is_signed_over_its_body(awsenv: AwsEnv) -> None:
    identity = aws(awsenv, "sts", "get-caller-identity", host="sts.test")
    assert identity.returncode == 0, identity.stderr
    assert json.loads(identity.stdout)["Account"] == "123456789012"


def test_a_presigned_url_made_in_the_sandbox_is_re_signed(awsenv: AwsEnv) -> None:
    awsenv.aws.objects["/bucket/shared.txt"] = b"presigned content\n"
    presigned = aws(awsenv, "s3", "presign", "s3://bucket/shared.txt")
    assert presigned.returncode == 0, presigned.stderr
    url = presigned.stdout.strip()
    assert "X-Amz-Signature=" in url and "UMBRAPLACEHOLDER" in url
    result = curl(awsenv.proxy, url)
    assert curl_status(result) == 200, result.stdout
    assert "presigned content" in result.stdout
    # A SigV2 presigned URL (awscli's default without s3v4) is not re-made: refused.
    v2 = url.split("?")[0] + "?AWSAccessKeyId=UMBRAPLACEHOLDER&Signature=abc%3D&Expires=1796538356"
    refused = curl(awsenv.proxy, v2, "-i")
    assert curl_status(refused) == 403 and "sigv4_missing" in refused.stdout


def test_a_region_or_service_the_rule_does_not_name_is_refused(awsenv: AwsEnv) -> None:
    mark = awsenv.proxy.log.mark()
    refused = aws(awsenv, "s3api", "list-buckets", "--region", "eu-west-1")
    assert refused.returncode != 0
    record = awsenv.proxy.log.wait_for(mark, lambda r: r.get("reason") == "sigv4_scope_refused")
    assert record["decision"] == "deny" and record["rule_id"] == "testing:s3"
    # An STS signature sent to the S3 host: the S3 rule signs s3 only.
    wrong = aws(awsenv, "sts", "get-caller-identity", host="s3.test")
    assert wrong.returncode != 0


def test_an_unsigned_request_is_not_signed_for_the_sandbox(awsenv: AwsEnv) -> None:
    result = curl(awsenv.proxy, f"https://s3.test:{awsenv.origin.port}/bucket/hello.txt", "-i")
    assert curl_status(result) == 403 and "sigv4_missing" in result.stdout


# ------------------------------------------------------------------ the signer on its own


def test_aws_chunked_signed_payload_chunks_are_re_signed_in_sequence() -> None:
    """STREAMING-AWS4-HMAC-SHA256-PAYLOAD: every chunk signature is chained from the new seed;
    checked here with an independent walk of the chain."""
    secret = AwsSigv4(kind="aws-sigv4", access_key_id=REAL_KEY_ID, secret_access_key=REAL_SECRET)
    placeholder_sig = "0" * 64
    data = [b"a" * 8192, b"b" * 100]
    body = b"".join(
        b"%x;chunk-signature=%s\r\n%s\r\n" % (len(piece), placeholder_sig.encode(), piece)
        for piece in [*data, b""]
    )
    headers = Headers(
        [
            (b"Authorization", b"AWS4-HMAC-SHA256 Credential=X/20260101/us-east-1/s3/aws4_request, "
             b"SignedHeaders=host;x-amz-content-sha256;x-amz-date, Signature=" + b"1" * 64),
            (b"X-Amz-Date", b"20260101T000000Z"),
            (b"X-Amz-Content-SHA256", b"STREAMING-AWS4-HMAC-SHA256-PAYLOAD"),
            (b"Content-Encoding", b"aws-chunked"),
        ]
    )  # fmt: skip
    now = datetime(2026, 12, 6, 5, 0, tzinfo=UTC)
    resigned = resign(method="PUT", path="/bucket/key", host="s3.test", headers=headers,
                      body=body, secret=secret, services=["s3"], regions=["us-east-1"], now=now)  # fmt: skip
    assert resigned.body is not None and len(resigned.body) == len(body)
    seed = headers["authorization"].rsplit("Signature=", 1)[1]
    scope = Scope("20261206", "us-east-1", "s3")
    key = signing_key(REAL_SECRET, scope.date, scope.region, scope.service)
    previous, expected = seed, b""
    for piece in [*data, b""]:
        text = chunk_string_to_sign("20261206T050000Z", scope, previous, piece)
        previous = hmac.new(key, text.encode(), hashlib.sha256).hexdigest()
        expected += b"%x;chunk-signature=%s\r\n%s\r\n" % (len(piece), previous.encode(), piece)
    assert resigned.body == expected
    with pytest.raises(Sigv4Error):  # a lying chunk size is refused, never passed on
        resign(method="PUT", path="/k", host="s3.test", headers=Headers(headers.fields),
               body=body.replace(b"2000;", b"2001;", 1), secret=secret, services=["s3"],
               regions=["us-east-1"], now=now)  # fmt: skip


@pytest.mark.parametrize("service", ["s3", "sts"])
def test_a_session_token_replaces_the_placeholder_one_in_both_forms(service: str) -> None:
    """Signed by botocore with placeholder keys and a placeholder session token, re-signed with
    temporary credentials (key and token), verified by botocore's signer with the real ones: the
    header form (S3's path as sent, STS's body hashed) and the presigned form."""
    from botocore.auth import S3SigV4Auth, S3SigV4QueryAuth, SigV4Auth  # type: ignore[import-untyped]
    from botocore.awsrequest import AWSRequest  # type: ignore[import-untyped]
    from botocore.credentials import Credentials  # type: ignore[import-untyped]

    from tests.proxy.harness import Seen

    token = "real-session-token/with+odd=chars"
    secret = AwsSigv4(kind="aws-sigv4", access_key_id=REAL_KEY_ID,
                      secret_access_key=REAL_SECRET, session_token=token)  # fmt: skip
    origin = AwsOrigin(REAL_KEY_ID, REAL_SECRET, token)
    placeholder = Credentials("UMBRAPLACEHOLDER", "umbra-placeholder", "umbra-placeholder-token")
    host = f"{service}.test"
    body = b"Action=GetCallerIdentity&Version=2011-06-15" if service == "sts" else b""
    path = "/bucket/a%20b/c.txt?list-type=2&prefix=x%2Fy" if service == "s3" else "/"
    request = AWSRequest(method="POST" if body else "GET", url=f"https://{host}{path}", data=body)
    if body:
        request.headers["Content-Type"] = "application/x-www-form-urlencoded"
    (S3SigV4Auth if service == "s3" else SigV4Auth)(placeholder, service, "us-east-1").add_auth(
        request
    )
    headers = Headers([(k.encode(), v.encode()) for k, v in request.headers.items()])
    resigned = resign(method=request.method, path=path, host=host, headers=headers, body=body,
                      secret=secret, services=[service], regions=["us-east-1"])  # fmt: skip
    assert token in resigned.placed and "umbra-placeholder-token" not in str(headers)
    seen = Seen(
        host,
        request.method,
        resigned.path,
        [(k.decode(), v.decode()) for k, v in headers.fields],
        body,
    )
    assert origin._verify(seen, f"https://{host}") is None

    if service != "s3":
        return
    presigning = AWSRequest(method="GET", url=f"https://{host}/bucket/shared.txt")
    S3SigV4QueryAuth(placeholder, "s3", "us-east-1", expires=600).add_auth(presigning)
    target = presigning.url.split(host, 1)[1]
    assert "X-Amz-Security-Token=umbra-placeholder-token" in target
    query_headers = Headers([(b"Host", host.encode())])
    made = resign(method="GET", path=target, host=host, headers=query_headers, body=b"",
                  secret=secret, services=["s3"], regions=["us-east-1"])  # fmt: skip
    assert "umbra-placeholder-token" not in made.path and "UMBRAPLACEHOLDER" not in made.path
    assert "X-Amz-Security-Token=real-session-token%2Fwith%2Bodd%3Dchars" in made.path
    seen = Seen(host, "GET", made.path, [("host", host)], b"")
    assert origin._verify(seen, f"https://{host}") is None
