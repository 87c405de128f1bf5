"""Seeding the embedded Console through its own API, as a developer would: log in, publish the
signed bundle, register the Security CVM and mint its enrollment token, set the walkthrough's
secrets."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from umbra.cli.up_stack.errors import UpError
from umbra.cli.up_stack.material import llm_keys, write_secret
from umbra.cli.up_stack.names import (
    DEMO_HOSTS,
    DEMO_SECRET_NAME,
    LLM_HOST,
    SECURITY_CVM_NAME,
    TEAM,
    Component,
    Port,
)
from umbra.cli.up_stack.supervise import Stack, umbra_executable
from umbra.console.enums import CvmKind, CvmState


def login(stack: Stack, env: dict[str, str]) -> None:
    done = subprocess.run(
        [umbra_executable(), "auth", "login", stack.console_url, "--issuer", stack.issuer_url,
         "--team", TEAM, "--json"],
        capture_output=True, text=True, env=env, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    if done.returncode != 0:
        raise UpError(f"login failed: {(done.stdout + done.stderr).strip()[-400:]}")


def token(env: dict[str, str]) -> str:
    base = env.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    doc = json.loads((Path(base) / "umbra" / "console.json").read_text())
    value: str = doc["token"]
    return value


def api(stack: Stack, bearer: str) -> httpx.Client:
    return httpx.Client(
        base_url=stack.console_url, headers={"Authorization": f"Bearer {bearer}"}, timeout=60
    )


def expect(response: httpx.Response, *ok: int) -> Any:
    """The response's JSON when its status is one of `ok`; else an UpError naming the call."""
    if response.status_code not in ok:
        raise UpError(
            f"Console {response.request.method} {response.request.url.path}: "
            f"{response.status_code} {response.text[:300]}"
        )
    return response.json() if response.content else None


def demo_profile(port: int) -> str:
    """The walkthrough's profile: the stand-in origin, GET and POST only, the demo token injected."""
    return f"""apiVersion: umbra/v1
kind: Profile
name: demo
description: umbra up's walkthrough origin (a local stand-in with its own CA).
egress:
  - id: demo-api
    allow: {{hosts: [{DEMO_HOSTS[0]}], ports: [{port}], methods: [GET, POST]}}
inject:
  - id: demo-token
    header: Authorization
    format: "Bearer {{secret}}"
    secret: team/{DEMO_SECRET_NAME}
    hosts: [{DEMO_HOSTS[0]}]
    ports: [{port}]
"""


def publish_bundle(stack: Stack, client: httpx.Client, policies: Path) -> int:
    from umbra.cli.up_agents import standin_profiles
    from umbra.policy.bundle import load_private_key, payload_document, sign_bundle
    from umbra.policy.loader import load_policy_dir

    work = stack.p("policy-build")
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(policies, work)
    (work / "profiles" / "zz-umbra-up-demo.yaml").write_text(demo_profile(stack.port(Port.ORIGIN)))
    for name, text in standin_profiles(LLM_HOST, stack.port(Port.LLM)).items():
        (work / "profiles" / f"zz-umbra-up-{name}.yaml").write_text(text)
    shutil.rmtree(work / "tests", ignore_errors=True)
    loaded = load_policy_dir(work)
    compiled = [p.compiled for p in loaded.profiles.values()]
    digest = hashlib.sha256(
        json.dumps(sorted(p.model_dump_json() for p in compiled)).encode()
    ).hexdigest()
    stack.state["bundle_profiles"] = sorted(loaded.profiles)
    if stack.state.get("bundle_digest") == digest:
        return int(stack.state["bundle_serial"])
    serial = max(int(time.time()), int(stack.state.get("bundle_serial", 0)) + 1)
    key = load_private_key(stack.p("keys", "dev-release.pem"))
    raw = sign_bundle(payload_document(compiled, serial, "umbra up: policies/"), [key])
    expect(client.post(f"/api/v1/teams/{TEAM}/bundles", content=raw), 200, 201)
    stack.state.update(bundle_digest=digest, bundle_serial=serial)
    stack.save()
    return serial


def ensure_security_cvm(stack: Stack, client: httpx.Client) -> str:
    """Register the Security CVM and hand its process a one-time enrollment token (never a
    credential: the proxy enrolls at start, proxy/enroll.py)."""
    from umbra.attest.enroll_client import spent_marker

    known = stack.state.get("security_cvm_id")
    credential = stack.p("security-cvm", "console-credential")
    token_file = stack.p("security-cvm", "enrollment-token")
    if known:
        info = client.get(f"/api/v1/cvms/{known}")
        gone = (CvmState.destroyed, CvmState.failed)
        if info.status_code == 200 and info.json().get("state") not in gone:
            if credential.exists() or token_file.exists():
                return str(known)  # enrolled, or about to enroll with its unspent token
            _mint_token(client, str(known), token_file)  # the credential was lost
            return str(known)
    created = expect(
        client.post(
            f"/api/v1/teams/{TEAM}/cvms",
            json={"name": f"{SECURITY_CVM_NAME}-{int(time.time())}", "kind": CvmKind.security},
        ),
        201,
    )
    stack.stop(Component.PROXY)  # it serves the old Security CVM's identity
    for stale in (credential, spent_marker(credential)):
        stale.unlink(missing_ok=True)
    _mint_token(client, str(created["id"]), token_file)
    stack.state["security_cvm_id"] = created["id"]
    stack.save()
    return str(created["id"])


def _mint_token(client: httpx.Client, cvm_id: str, token_file: Path) -> None:
    minted = expect(client.post(f"/api/v1/cvms/{cvm_id}/enrollment-token"), 201)
    write_secret(token_file, str(minted["token"]).encode())


def ensure_demo_secret(client: httpx.Client, value: str) -> None:
    ensure_secret(client, f"team/{DEMO_SECRET_NAME}", value, DEMO_HOSTS[0])


def ensure_secret(client: httpx.Client, ref: str, value: str, host: str) -> None:
    """Set a team (`team/NAME`) or the developer's personal (`personal/NAME`) secret."""
    scope, name = ref.split("/", 1)
    path = "secrets" if scope == "team" else "personal-secrets"
    expect(
        client.put(f"/api/v1/teams/{TEAM}/{path}/{name}", json={"value": value, "hosts": [host]}),
        200,
        201,
    )


def ensure_llm_secrets(stack: Stack, client: httpx.Client) -> None:
    from umbra.cli.up_agents import ANTHROPIC_KEY_REF, OPENAI_KEY_REF

    keys = llm_keys(stack)
    ensure_secret(client, ANTHROPIC_KEY_REF, keys["anthropic-api-key"], LLM_HOST)
    ensure_secret(client, OPENAI_KEY_REF, keys["openai-api-key"], LLM_HOST)
