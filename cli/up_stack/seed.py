"""Seeding the embedded Console through its own API, as a developer would: log in, publish the
signed bundle, register the Security CVM and mint its enrollment token (under qemu: launch it as
a VM, its token in its launch data), set the walkthrough's secrets."""

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
from umbra.cli.up_stack.qemu import Runtime, runtime
from umbra.cli.up_stack.supervise import Stack, umbra_executable
from umbra.cli.up_stack.vms import vms
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
    credential: the proxy enrolls at start, proxy/enroll.py). Under qemu: `_security_vm`."""
    from umbra.attest.enroll_client import spent_marker

    if runtime(stack) is Runtime.qemu:
        return _security_vm(stack, client)
    known = stack.state.get("security_cvm_id")
    credential = stack.p("security-cvm", "console-credential")
    token_file = stack.p("security-cvm", "enrollment-token")
    if known:
        info = client.get(f"/api/v1/cvms/{known}")
        record = info.json() if info.status_code == 200 else {}
        live = record.get("state") not in (None, CvmState.destroyed, CvmState.failed)
        if live and record.get("provider") == "qemu":
            # An earlier `--runtime qemu`'s VM, gone with its Console: this host's proxy
            # could not speak for it.
            client.delete(f"/api/v1/cvms/{known}")
        elif live:
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


def _security_vm(stack: Stack, client: httpx.Client) -> str:
    """The Security CVM launched through the Console's `qemu` provider, as an admin's `umbra cvm
    launch --kind security` does: its one-time token travels in its launch data and its proxy
    enrolls from inside the VM. Kept while its VM runs."""
    known = stack.state.get("security_cvm_id")
    if known and kept_vm(stack, client, str(known), "Security CVM") is not None:
        return str(known)
    created = expect(
        client.post(
            f"/api/v1/teams/{TEAM}/cvms",
            json={"name": f"{SECURITY_CVM_NAME}-{int(time.time())}", "kind": CvmKind.security,
                  "provider": "qemu"},
        ),
        201,
    )  # fmt: skip
    wait_settled(client, str(created["id"]), CvmState.launching, "Security CVM")
    stack.state["security_cvm_id"] = created["id"]
    stack.save()
    return str(created["id"])


def kept_vm(stack: Stack, client: httpx.Client, cvm_id: str, what: str) -> dict[str, Any] | None:
    """A VM the Console launched that still runs (same Console process, QEMU alive): its record.
    Otherwise it went with the Console that launched it (the provider is not resumable): its
    record is destroyed and None returned, for a new launch."""
    info = client.get(f"/api/v1/cvms/{cvm_id}")
    alive = any(vm.cvm_id == cvm_id for vm in vms(stack))
    record = info.json() if info.status_code == 200 else None
    state = record.get("state") if record else None
    if alive and record and state == CvmState.running:
        return dict(record)
    if state is not None and state not in (CvmState.destroyed, CvmState.destroying):
        stack.progress(f"the VM of the {what} {cvm_id} ended with its Console: launching anew")
        client.delete(f"/api/v1/cvms/{cvm_id}")
    return None


def wait_settled(client: httpx.Client, cvm_id: str, transitional: CvmState, what: str) -> None:
    """The Console's provisioning job launches (or updates) the CVM in the background."""
    info = expect(client.get(f"/api/v1/cvms/{cvm_id}"), 200)
    end = time.monotonic() + 120
    while info.get("state") == transitional and time.monotonic() < end:
        time.sleep(0.1)
        info = expect(client.get(f"/api/v1/cvms/{cvm_id}"), 200)
    if info.get("state") != CvmState.running:
        raise UpError(f"the {what} did not start: {info.get('state_reason') or info}")


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
