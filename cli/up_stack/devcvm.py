"""The local Dev CVM: the sandbox image it runs, its launch through the Console (as `umbra cvm
launch` does; the Console's local provider builds it), and the sandbox trusting the Security
CVM's interception CA."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from umbra.cli.up_stack import qemu
from umbra.cli.up_stack.errors import UpError
from umbra.cli.up_stack.names import DEV_CVM_NAME, TEAM
from umbra.cli.up_stack.seed import expect, kept_vm, wait_settled
from umbra.cli.up_stack.supervise import Stack
from umbra.console.enums import CvmState
from umbra.sandbox import local_cvm
from umbra.sandbox.render import CA_NAME

# Attached to the Dev CVM when the bundle has them: the walkthrough's origin and daily work
# (Python, npm, Debian, public git; policies/tests/daily-work.yaml).
WHAT = "Dev CVM"
DEFAULT_PROFILES = (
    "demo", "pypi", "npm", "debian", "git-public", "anthropic-standin", "openai-standin",
)  # fmt: skip


def ensure_dev_cvm(stack: Stack, client: httpx.Client, scvm_id: str, ssh_keys: list[str]) -> str:
    """Launch the Dev CVM as `umbra cvm launch` does, or bring the known one back up."""
    known = stack.state.get("dev_cvm_id")
    if known and qemu.runtime(stack) is qemu.Runtime.qemu:
        if _qemu_vm_usable(stack, client, str(known), scvm_id, ssh_keys):
            return str(known)
    elif known:
        info = client.get(f"/api/v1/cvms/{known}")
        plan = local_cvm.load_plan(stack.p("cvms"), str(known))
        # A CVM launched without the SSH ingress (an older state directory) is launched anew.
        usable = plan is not None and plan.ingress_config.exists()
        running = info.status_code == 200 and info.json().get("state") == CvmState.running
        if running and plan and usable:
            local_cvm.ensure_network(plan)
            local_cvm.ensure_running(plan)
            if _canonical(info.json().get("ssh_keys", [])) != _canonical(ssh_keys):
                # The developer's key changed (e.g. they made ~/.ssh/id_ed25519 since): bind
                # the new one; the provider restarts the ingress with it.
                patch = client.patch(f"/api/v1/cvms/{known}", json={"ssh_keys": ssh_keys})
                wait_settled(client, str(expect(patch, 200)["id"]), CvmState.updating, WHAT)
            return str(known)
        if info.status_code == 200 and info.json().get("state") != CvmState.destroyed:
            client.delete(f"/api/v1/cvms/{known}")
    # The team's defaults: the Console attaches them to the Dev CVM at launch (any provider).
    profiles = [p for p in DEFAULT_PROFILES if p in stack.state.get("bundle_profiles", [])]
    expect(client.put(f"/api/v1/teams/{TEAM}/default-profiles", json={"profiles": profiles}), 200)
    created = expect(
        client.post(
            f"/api/v1/teams/{TEAM}/cvms",
            json={
                "name": f"{DEV_CVM_NAME}-{int(time.time())}",
                "security_cvm_id": scvm_id,
                "ssh_keys": ssh_keys,
                # runc: the local provider builds a sandbox here; qemu: the VM boots.
                "provider": "qemu" if qemu.runtime(stack) is qemu.Runtime.qemu else "local",
            },
        ),
        201,
    )
    wait_settled(client, str(created["id"]), CvmState.launching, WHAT)
    stack.state["dev_cvm_id"] = created["id"]
    stack.save()
    return str(created["id"])


def _qemu_vm_usable(
    stack: Stack, client: httpx.Client, cvm_id: str, scvm_id: str, ssh_keys: list[str]
) -> bool:
    """The Dev VM still runs, attached to this Security CVM (a relaunched Security CVM means a
    new Dev VM): kept, its keys brought up to date."""
    record = kept_vm(stack, client, cvm_id, WHAT)
    if record is None:
        return False
    if record.get("security_cvm_id") != scvm_id:
        stack.progress(f"the {WHAT} {cvm_id} belongs to another Security CVM: launching anew")
        client.delete(f"/api/v1/cvms/{cvm_id}")
        return False
    if _canonical(record.get("ssh_keys", [])) != _canonical(ssh_keys):
        patch = client.patch(f"/api/v1/cvms/{cvm_id}", json={"ssh_keys": ssh_keys})
        wait_settled(client, str(expect(patch, 200)["id"]), CvmState.updating, WHAT)
    return True


def _canonical(keys: list[str]) -> set[str]:
    from umbra.attest.measurement import canonical_ssh_key

    return {canonical_ssh_key(k) for k in keys}


def ensure_sandbox_image(stack: Stack) -> tuple[Path, ...]:
    """The sandbox image, built once per machine (minutes, with progress) and then cached."""
    from umbra.sandbox import image

    try:
        return image.ensure_image(progress=stack.progress)
    except image.ImageError as exc:
        raise UpError(str(exc), "see the line above; then run `umbra up` again") from None


def wait_sandbox_ca(stack: Stack, cvm_id: str, timeout: float = 60) -> None:
    """The sandbox trusts the Security CVM's interception CA once its forwarder has fetched it
    inside an attested session and the sandbox's init has put it in the system store (as in the
    cloud: sandbox_ca.py, umbra-sandbox-init)."""
    plan = local_cvm.load_plan(stack.p("cvms"), cvm_id)
    if plan is None:
        return
    installed = plan.rootfs / local_cvm.CA_INSTALLED.lstrip("/")
    fetched = plan.dir / "sandbox-ca" / CA_NAME
    started = time.monotonic()
    end = started + timeout
    restarted = False
    while time.monotonic() < end:
        if installed.exists():
            return
        if not restarted and not fetched.exists() and time.monotonic() - started > 1:
            # The forwarder started before the Security CVM and is backing off (up to 30 s):
            # a fresh one fetches at once, inside its own attested session as always.
            local_cvm.stop(plan, "forwarder")
            local_cvm.ensure_running(plan)
            restarted = True
        time.sleep(0.2)
    raise UpError(
        f"the sandbox of {cvm_id} did not install the Security CVM's CA within {timeout:.0f} s",
        f"see {plan.dir / 'forwarder.log'}",
    )
