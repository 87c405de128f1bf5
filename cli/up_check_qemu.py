"""`umbra up --runtime qemu --check`: the seed's day against the Dev CVM booted under QEMU.

Each step is bounded and reports ✓/✗ with its seconds and reason; a step that needs something an
earlier one did not give fails at once, naming what is missing (never a wait to a timeout):

1. **launch**: the Console launched the VM through its `qemu` provider (`provider_state.runtime`
   qemu, QEMU running) and its launch agent started the release's compose (the serial console's
   `umbra-launch: dev-cvm ID started` line of this boot);
2. **enrollment**: the VM's forwarder enrolled (`cvm.enroll` for this CVM in the audit log);
3. **ssh**: `umbra ssh --no-reuse CVM -- id -u` answers the sandbox user (`provider_state.ssh_ingress`
   recorded by the provider);
4. **requests**: through `umbra ssh`, an allowed request (the demo token injected by the Security
   CVM) and a denied host, then their two records in the Console's traffic log;
5. **stop and start**: `PATCH state=stopped` (the provider presses the ACPI power button; QEMU
   gone, `stopped`), then `running` again: a new boot whose launch agent started again;
6. **reboot: workspace kept, re-enrollment**: after that new boot, the workspace is the one
   before it (a file written over `umbra ssh` before the stop, read back after) and the
   forwarder renewed its credential by a fresh quote (`cvm.reenroll`, no new token).

The VM is `qemu.yaml` as the emulated clouds boot it (cli/up_stack/os_disk.py): the dev host
(runc, the sandbox image, the forwarder) and the attested SSH ingress, as on GCP and Azure.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from umbra.cli.up_stack import DEMO_HOSTS, TEAM, Stack, UpError, expect, umbra_executable
from umbra.cli.up_stack import vms as q
from umbra.console.enums import CvmState
from umbra.contracts.traffic import Decision
from umbra.sandbox import local_cvm

# A boot under TCG takes minutes on 2 shared cores; under KVM seconds.
BOOT_LIMIT = {"tcg": 1200.0, "kvm": 300.0}
STOP_LIMIT = 360.0  # the provider waits 300 s for the power button, then kills
# From the agent's `started` line: the forwarder's enrollment, the first `umbra ssh` (attesting
# the VM, sshd and runc exec under TCG) and the first request (the forwarder attests the
# Security CVM) each take tens of seconds on 2 shared cores.
ENROLL_LIMIT = 600.0
SSH_LIMIT = 600.0
REQUEST_LIMIT = 300.0
MARKER = "/home/dev/umbra-check-workspace"


@dataclass(frozen=True)
class StepResult:
    name: str
    ok: bool
    seconds: float
    detail: str

    def as_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "seconds": self.seconds, "detail": self.detail}


class StepFailed(Exception):
    """This step's reason (the walkthrough goes on with the next one)."""


@dataclass
class _Boot:
    number: int
    serial: Path
    text: str = ""


def boot_of(info: dict[str, Any]) -> _Boot:
    state = info.get("provider_state") or {}
    if state.get("runtime") != "qemu" or not state.get("serial"):
        raise StepFailed(f"the Console's record is not a qemu VM's: provider_state {state}")
    return _Boot(int(state.get("boot", 1)), Path(state["serial"]))


def wait_started(stack: Stack, cvm_id: str, boot: _Boot, limit: float) -> _Boot:
    """Until this boot's launch agent started the compose; fails at once if QEMU exits or the
    agent refused."""
    end = time.monotonic() + limit
    want = f"umbra-launch: dev-cvm {cvm_id} started"
    while True:
        with contextlib.suppress(OSError):
            boot.text = boot.serial.read_text(errors="replace")
        if want in boot.text:
            return boot
        refused = re.search(r"umbra-launch: REFUSED[^\n]*", boot.text)
        if refused:
            raise StepFailed(f"boot {boot.number}: {refused[0].strip()}")
        if not any(vm.cvm_id == cvm_id for vm in q.vms(stack)):
            log = boot.serial.with_suffix(".qemu.log")
            why = log.read_text(errors="replace")[-400:] if log.exists() else ""
            raise StepFailed(
                f"boot {boot.number}: QEMU exited before the launch agent started "
                f"({why.strip() or 'no message'}); serial: {boot.text[-600:]}"
            )
        if time.monotonic() > end:
            raise StepFailed(
                f"boot {boot.number}: no `{want}` on the serial console within {limit:.0f} s "
                f"({boot.serial}): {boot.text[-600:]}"
            )
        time.sleep(1)


def wait_state(client: httpx.Client, cvm_id: str, want: CvmState, limit: float) -> dict[str, Any]:
    end = time.monotonic() + limit
    while True:
        info: dict[str, Any] = expect(client.get(f"/api/v1/cvms/{cvm_id}"), 200)
        if info.get("state") == want:
            return info
        if info.get("state") == CvmState.failed:
            raise StepFailed(f"the Console marked it failed: {info.get('state_reason')}")
        if time.monotonic() > end:
            raise StepFailed(f"not {want} within {limit:.0f} s (state {info.get('state')})")
        time.sleep(1)


def audited(client: httpx.Client, cvm_id: str, action: str, after: int = 0) -> int | None:
    """The sequence number of the first `action` audited for `cvm_id` after `after`."""
    cursor: int | None = after
    while cursor is not None:
        page = expect(client.get(f"/api/v1/teams/{TEAM}/audit", params={"after": cursor}), 200)
        for entry in page["entries"]:
            if entry["action"] == action and entry["target"] == cvm_id:
                return int(entry["seq"])
        cursor = page.get("next_cursor")
    return None


def last_seq(client: httpx.Client) -> int:
    cursor, last = 0, 0
    while True:
        page = expect(client.get(f"/api/v1/teams/{TEAM}/audit", params={"after": cursor}), 200)
        if page["entries"]:
            last = int(page["entries"][-1]["seq"])
        if page.get("next_cursor") is None:
            return last
        cursor = page["next_cursor"]


def wait_audited(client: httpx.Client, cvm_id: str, action: str, after: int) -> int:
    end = time.monotonic() + ENROLL_LIMIT
    while time.monotonic() < end:
        seq = audited(client, cvm_id, action, after)
        if seq is not None:
            return seq
        time.sleep(1)
    raise StepFailed(f"no {action} audited for {cvm_id} within {ENROLL_LIMIT:.0f} s")


def ssh(cvm_id: str, command: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """`umbra ssh --no-reuse CVM -- COMMAND`, as a developer runs it; its warm agent is stopped
    afterwards. One argument: SSH joins the words after `--` into one line the remote shell
    parses (so `sh -c id -u` would run `id` alone)."""
    with tempfile.TemporaryDirectory(prefix="umbra-up-ssh-") as tmp:
        env = {**os.environ, "TMPDIR": tmp}
        try:
            return subprocess.run(
                [umbra_executable(), "ssh", "--no-reuse", cvm_id, "--", command],
                capture_output=True, text=True, timeout=timeout, env=env,
                stdin=subprocess.DEVNULL,
            )  # fmt: skip
        finally:
            for pid_file in Path(tmp).glob("umbra-ssh-*/agent-*.pid"):
                with contextlib.suppress(OSError, ValueError):
                    os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)


def need_ssh(info: dict[str, Any]) -> None:
    if not (info.get("provider_state") or {}).get("ssh_ingress"):
        raise StepFailed(
            "the Console recorded no SSH ingress for the VM (provider_state.ssh_ingress): "
            "`umbra ssh` has nothing to reach"
        )


def ssh_until(
    cvm_id: str, command: str, ok: Callable[[subprocess.CompletedProcess[str]], bool], limit: float
) -> subprocess.CompletedProcess[str]:
    """`ssh` retried every 10 s while the VM comes up, until `ok` or `limit` seconds: the last
    attempt either way (the caller says what it lacked)."""
    end = time.monotonic() + limit
    while True:
        done = ssh(cvm_id, command, timeout=300)
        if ok(done) or time.monotonic() > end:
            return done
        time.sleep(10)


def ssh_check(cvm_id: str) -> str:
    """`id -u` over `umbra ssh`, retried while the VM's ingress and sandbox come up."""
    user = str(local_cvm.SANDBOX_USER_UID)
    done = ssh_until(
        cvm_id, "id -u", lambda d: d.returncode == 0 and d.stdout.strip() == user, SSH_LIMIT
    )
    uid = done.stdout.strip()
    if done.returncode != 0 or uid != user:
        raise StepFailed(
            f"`umbra ssh {cvm_id} -- id -u` failed (exit {done.returncode}) for "
            f"{SSH_LIMIT:.0f} s: {(done.stderr.strip() or uid)[-400:]}"
        )
    return f"umbra ssh {cvm_id} -- id -u → {uid} (the sandbox user)"


def _status(done: subprocess.CompletedProcess[str]) -> tuple[int, list[str]]:
    """curl's `-w '\\n%{http_code}'` last line, and the body's lines before it."""
    lines = done.stdout.strip().splitlines() or ["0"]
    return (int(lines[-1]) if lines[-1].isdigit() else 0), lines[:-1]


def _answered(want: int) -> Callable[[subprocess.CompletedProcess[str]], bool]:
    return lambda done: _status(done)[0] == want


def requests_check(stack: Stack, client: httpx.Client, cvm_id: str, secret: str) -> str:
    """An allowed request with the token injected, a denied host; their two records."""
    api, evil = DEMO_HOSTS
    port = stack.port("origin")
    started = time.time()
    answers = {}
    for host, path, want in ((api, "/v1/whoami", 200), (evil, "/", 403)):
        url = f"https://{host}:{port}{path}"
        # The first request may come before the sandbox trusts the Security CVM's CA (the
        # forwarder fetches it in its first attested session): retried, bounded.
        curl = f"curl -sS --max-time 120 -w '\\n%{{http_code}}' {url}"
        done = ssh_until(cvm_id, curl, _answered(want), REQUEST_LIMIT)
        code, body = _status(done)
        if code != want:
            raise StepFailed(f"GET {host}{path} → {code}, wanted {want}: {done.stderr[-300:]}")
        answers[host] = "\n".join(body)
    try:
        seen = json.loads(answers[api]).get("authorization_sha256")
    except ValueError:
        seen = None
    if seen != hashlib.sha256(f"Bearer {secret}".encode()).hexdigest():
        raise StepFailed("the allowed request reached the origin without the injected token")
    want_records = {("GET", api, Decision.ALLOW), ("GET", evil, Decision.DENY)}
    after = datetime.fromtimestamp(started - 2, UTC)
    end = time.monotonic() + 60
    while time.monotonic() < end:
        page = client.get(f"/api/v1/teams/{TEAM}/traffic", params={"cvm_id": cvm_id, "limit": 200})
        if page.status_code == 200:
            got = {
                (r.get("method"), r.get("connect_host"), r.get("decision"))
                for r in page.json()["records"]
                if r.get("cvm_id") == cvm_id and datetime.fromisoformat(r["time"]) >= after
            }
            if got >= want_records:
                return f"GET {api} 200 (token injected), GET {evil} 403; both recorded for the CVM"
        time.sleep(0.5)
    raise StepFailed("the Console did not receive both records within 60 s")


Report = Callable[[StepResult], None]


class Walkthrough:
    def __init__(
        self, stack: Stack, client: httpx.Client, cvm_id: str, secret: str, report: Report
    ) -> None:
        self.stack, self.client, self.cvm_id, self.secret = stack, client, cvm_id, secret
        self.report = report
        self.results: list[StepResult] = []
        self.limit = BOOT_LIMIT.get(str(stack.state.get("accel")), BOOT_LIMIT["tcg"])

    def step(self, name: str, run: Callable[[], str]) -> bool:
        started = time.monotonic()
        try:
            ok, detail = True, run()
        except StepFailed as exc:
            ok, detail = False, str(exc)
        result = StepResult(name, ok, round(time.monotonic() - started, 1), detail)
        self.results.append(result)
        self.report(result)
        return ok

    def info(self) -> dict[str, Any]:
        return dict(expect(self.client.get(f"/api/v1/cvms/{self.cvm_id}"), 200))

    def run(self) -> list[StepResult]:
        cvm = self.cvm_id
        boot = _Boot(0, Path())
        start_seq = 0

        def launch() -> str:
            nonlocal boot
            info = wait_state(self.client, cvm, CvmState.running, 120)
            boot = wait_started(self.stack, cvm, boot_of(info), self.limit)
            shape = (info.get("provider_state") or {}).get("shape")
            return f"{shape} shape, boot {boot.number}: the launch agent started the compose"

        if not self.step("launch through the Console", launch):
            return self.results

        self.step(
            "enrollment",
            lambda: f"cvm.enroll #{wait_audited(self.client, cvm, 'cvm.enroll', 0)}",
        )

        def ssh_step() -> str:
            need_ssh(self.info())
            return ssh_check(cvm)

        ssh_ok = self.step("umbra ssh", ssh_step)

        def requests() -> str:
            if not ssh_ok:
                raise StepFailed("needs `umbra ssh` (above)")
            return requests_check(self.stack, self.client, cvm, self.secret)

        self.step("an allowed and a denied request, recorded", requests)

        token = secrets.token_hex(8)
        wrote = ssh(cvm, f"echo {token} > {MARKER} && sync") if ssh_ok else None
        start_seq = last_seq(self.client)

        def stop_and_start() -> str:
            nonlocal boot
            patch = self.client.patch(f"/api/v1/cvms/{cvm}", json={"state": "stopped"})
            expect(patch, 200)
            wait_state(self.client, cvm, CvmState.stopped, STOP_LIMIT)
            if any(vm.cvm_id == cvm for vm in q.vms(self.stack)):
                raise StepFailed("the Console says stopped, but its QEMU still runs")
            expect(self.client.patch(f"/api/v1/cvms/{cvm}", json={"state": "running"}), 200)
            wait_state(self.client, cvm, CvmState.running, 120)
            # A start records no new provider_state: the next boot's serial log says it.
            serial = boot.serial.with_name(f"serial-{boot.number + 1}.log")
            end = time.monotonic() + 60
            while not serial.exists():
                if time.monotonic() > end:
                    raise StepFailed(f"started, but no boot {boot.number + 1} ({serial})")
                time.sleep(0.5)
            boot = wait_started(self.stack, cvm, _Boot(boot.number + 1, serial), self.limit)
            return f"stopped (ACPI), started: boot {boot.number} started the compose again"

        if not self.step("stop and start", stop_and_start):
            return self.results

        def workspace() -> str:
            if wrote is None or wrote.returncode != 0:
                why = "no `umbra ssh` (above)" if wrote is None else wrote.stderr.strip()[-300:]
                raise StepFailed(f"nothing was written before the stop: {why}")
            need_ssh(self.info())
            ssh_check(cvm)  # the ingress is up again (retried, bounded)
            read = ssh(cvm, f"cat {MARKER}", timeout=300)
            if read.stdout.strip() != token:
                raise StepFailed(f"{MARKER} after the reboot: {read.stdout.strip()!r}")
            return f"{MARKER} written before the stop was there after it"

        self.step("reboot: workspace kept", workspace)

        def reenrolled() -> str:
            seq = wait_audited(self.client, cvm, "cvm.reenroll", start_seq)
            # A fresh quote, no new token: the one issued at launch is still the only one.
            if audited(self.client, cvm, "cvm.enrollment_token", start_seq) is not None:
                raise StepFailed("the restart needed a new enrollment token")
            return f"cvm.reenroll #{seq} by a fresh quote (no new token)"

        self.step("reboot: re-enrollment", reenrolled)
        return self.results


def run_check(
    stack: Stack, client: httpx.Client, cvm_id: str, secret: str, report: Report
) -> list[StepResult]:
    if not cvm_id:
        raise UpError("no Dev CVM to check", "run `umbra up --runtime qemu` first")
    return Walkthrough(stack, client, cvm_id, secret, report).run()
