"""`umbra up --runtime qemu --check`: the seed's day against the Security CVM and the Dev CVM
booted under QEMU.

Each step is bounded and reports ✓/✗ with its seconds and reason; a step that needs something an
earlier one did not give fails at once, naming what is missing (never a wait to a timeout):

1. **launch**: the Console launched both VMs through its `qemu` provider (`provider_state.runtime`
   qemu, QEMU running) and each launch agent started its release's compose (the serial console's
   `umbra-launch: ROLE ID started` line of this boot);
2. **enrollment**: the Security CVM's proxy and the Dev CVM's forwarder enrolled (`cvm.enroll`
   for each in the audit log);
3. **ssh**: `umbra ssh --no-reuse CVM -- id -u` answers the sandbox user (`provider_state.ssh_ingress`
   recorded by the provider);
4. **requests**: through `umbra ssh`, an allowed request (the demo token injected by the Security
   CVM's proxy, in its VM) and a denied host, then their two records in the Console's traffic log;
5. **reboot (reset)**: the Dev VM's reset button (QMP `system_reset`, as `gcloud compute
   instances reset` or `az vm restart`): the TD ends, the provider boots a new one on the same
   disks (emulated/qemu.py "Reboot"), whose launch agent starts again; the Console's record stays
   `running`;
6. **reboot: workspace kept, re-enrollment**: the workspace is the one before (a file written
   over `umbra ssh` at the first boot, read back), and the forwarder renewed its credential by a
   fresh quote (`cvm.reenroll`, no new token);
7. **stop and start**: `PATCH state=stopped` for both (the provider presses the ACPI power
   button; QEMU gone, `stopped`), the Dev CVM first, then `running` again, the Security CVM
   first: a new boot of each whose launch agent started again, on the same data disks;
8. **stop and start: re-enrollment, workspace, a request**: the workspace file still there, the
   proxy and the forwarder each re-enrolled by a fresh quote (no new token), and an allowed
   request works again.

`--short` leaves 5-6 out and stops and starts only the Dev CVM (its idle auto-stop's path; a
Security CVM never stops on its own): two TCG boots less. 7 boots a new TD on the same disks as
5 does; what differs is the provider's side, held by tests/console/test_providers_qemu.py and
the stand-in hypervisor's wiring test.

The VMs are `qemu.yaml` as the emulated clouds boot it (cli/up_stack/os_disk.py): Docker and the
proxy image for the Security CVM; the dev host (runc, the sandbox image, the forwarder) and the
attested SSH ingress for the Dev CVM; as on GCP and Azure.
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


def wait_started(stack: Stack, cvm_id: str, boot: _Boot, limit: float, role: str) -> _Boot:
    """Until this boot's launch agent started the compose of `role` (`dev-cvm`,
    `security-cvm`); fails at once if QEMU exits or the agent refused."""
    end = time.monotonic() + limit
    want = f"umbra-launch: {role} {cvm_id} started"
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


def get_until(cvm_id: str, url: str, want: int) -> tuple[int, list[str], str]:
    """GET `url` with curl in the sandbox (its proxy variables: the forwarder), retried until it
    answers `want` or REQUEST_LIMIT: the status, the body's lines and curl's stderr."""
    curl = f"curl -sS --max-time 120 -w '\\n%{{http_code}}' {url}"
    done = ssh_until(cvm_id, curl, _answered(want), REQUEST_LIMIT)
    return (*_status(done), done.stderr)


def requests_check(stack: Stack, client: httpx.Client, cvm_id: str, secret: str) -> str:
    """An allowed request with the token injected, a denied host; their two records."""
    api, evil = DEMO_HOSTS
    port = stack.port("origin")
    started = time.time()
    answers = {}
    for host, path, want in ((api, "/v1/whoami", 200), (evil, "/", 403)):
        # The first request may come before the sandbox trusts the Security CVM's CA (the
        # forwarder fetches it in its first attested session): retried, bounded.
        code, body, stderr = get_until(cvm_id, f"https://{host}:{port}{path}", want)
        if code != want:
            raise StepFailed(f"GET {host}{path} → {code}, wanted {want}: {stderr[-300:]}")
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
        self,
        stack: Stack,
        client: httpx.Client,
        cvm_id: str,
        secret: str,
        report: Report,
        short: bool = False,
    ) -> None:
        self.stack, self.client, self.cvm_id, self.secret = stack, client, cvm_id, secret
        self.short = short
        self.security_id = str(stack.state.get("security_cvm_id") or "")
        self.report = report
        self.results: list[StepResult] = []
        self.limit = BOOT_LIMIT.get(str(stack.state.get("accel")), BOOT_LIMIT["tcg"])
        # Each VM's current boot, the Security CVM's first (it starts first).
        self.boots: dict[str, _Boot] = {}

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

    def roles(self) -> dict[str, str]:
        return {self.security_id: "security-cvm", self.cvm_id: "dev-cvm"}

    def launched(self) -> str:
        shape = ""
        for cvm, role in self.roles().items():
            info = wait_state(self.client, cvm, CvmState.running, 120)
            self.boots[cvm] = wait_started(self.stack, cvm, boot_of(info), self.limit, role)
            shape = (info.get("provider_state") or {}).get("shape", "")
        return (
            f"{shape} shape: the Security CVM's and the Dev CVM's launch agents started their "
            "compose"
        )

    def enrolled(self) -> str:
        seqs = [wait_audited(self.client, cvm, "cvm.enroll", 0) for cvm in self.roles()]
        return "cvm.enroll " + ", ".join(f"#{seq}" for seq in seqs) + " (Security, Dev)"

    def restarted(self) -> dict[str, str]:
        """The VMs the stop and start takes, in their start order (the Security CVM first)."""
        return {self.cvm_id: "dev-cvm"} if self.short else self.roles()

    def stop_and_start(self) -> str:
        cvms = self.restarted()
        for cvm in reversed(cvms):  # the Dev CVM first, as a team's day ends
            expect(self.client.patch(f"/api/v1/cvms/{cvm}", json={"state": "stopped"}), 200)
            wait_state(self.client, cvm, CvmState.stopped, STOP_LIMIT)
            if any(vm.cvm_id == cvm for vm in q.vms(self.stack)):
                raise StepFailed(f"the Console says {cvm} stopped, but its QEMU still runs")
        for cvm in cvms:
            expect(self.client.patch(f"/api/v1/cvms/{cvm}", json={"state": "running"}), 200)
            wait_state(self.client, cvm, CvmState.running, 120)
        for cvm, role in cvms.items():
            self.next_boot(cvm, role)
        numbers = ", ".join(str(self.boots[cvm].number) for cvm in cvms)
        which, roles = "the Dev CVM" if self.short else "both", ", ".join(cvms.values())
        return f"{which} stopped (ACPI) and started: boots {numbers} ({roles}) started again"

    def next_boot(self, cvm: str, role: str) -> None:
        """Until the boot after the current one started its compose (a start or a reset records
        no new provider_state: the next boot's serial log says it)."""
        boot = self.boots[cvm]
        serial = boot.serial.with_name(f"serial-{boot.number + 1}.log")
        end = time.monotonic() + 60
        while not serial.exists():
            if time.monotonic() > end:
                raise StepFailed(f"{cvm}: no boot {boot.number + 1} ({serial})")
            time.sleep(0.5)
        self.boots[cvm] = wait_started(
            self.stack, cvm, _Boot(boot.number + 1, serial), self.limit, role
        )

    def reboot(self) -> str:
        """The Dev VM's reset button (as `gcloud compute instances reset`): the TD ends, the
        provider boots a new one on the same disks, the Console's record stays running."""
        vm = next((vm for vm in q.vms(self.stack) if vm.cvm_id == self.cvm_id), None)
        if vm is None or vm.qmp is None or not q.reset(vm.qmp):
            raise StepFailed(f"no QEMU (or no QMP) of {self.cvm_id} to reset")
        self.next_boot(self.cvm_id, "dev-cvm")
        state = self.info().get("state")
        if state != CvmState.running:
            raise StepFailed(f"after the reset the Console says {state}, not running")
        number = self.boots[self.cvm_id].number
        return f"reset: the TD ended, boot {number} (a new TD) started its compose; still running"

    def reenrolled(self, cvms: list[str], after: int) -> str:
        """Each of `cvms` renewed its credential by a fresh quote after `after`, with no new
        enrollment token (the one issued at launch is still the only one)."""
        seqs = []
        for cvm in cvms:
            seqs.append(wait_audited(self.client, cvm, "cvm.reenroll", after))
            if audited(self.client, cvm, "cvm.enrollment_token", after) is not None:
                raise StepFailed(f"the restart of {cvm} needed a new enrollment token")
        quotes = "a fresh quote" if len(seqs) == 1 else "fresh quotes"
        return f"cvm.reenroll {', '.join(f'#{seq}' for seq in seqs)} by {quotes} (no new token)"

    def request_again(self) -> str:
        api = DEMO_HOSTS[0]
        url = f"https://{api}:{self.stack.port('origin')}/v1/whoami"
        code, _, stderr = get_until(self.cvm_id, url, 200)
        if code != 200:
            raise StepFailed(f"GET {api} → {code}: {stderr[-300:]}")
        return f"GET {api} 200"

    def run(self) -> list[StepResult]:
        cvm = self.cvm_id
        if not self.security_id:
            raise UpError("no Security CVM to check", "run `umbra up --runtime qemu` first")
        if not self.step("launch through the Console", self.launched):
            return self.results
        self.step("enrollment", self.enrolled)

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

        def workspace() -> str:
            if wrote is None or wrote.returncode != 0:
                why = "no `umbra ssh` (above)" if wrote is None else wrote.stderr.strip()[-300:]
                raise StepFailed(f"nothing was written before: {why}")
            need_ssh(self.info())
            ssh_check(cvm)  # the ingress is up again (retried, bounded)
            read = ssh(cvm, f"cat {MARKER}", timeout=300)
            if read.stdout.strip() != token:
                raise StepFailed(f"{MARKER} after the new boot: {read.stdout.strip()!r}")
            return f"{MARKER}, written at the first boot, read back over umbra ssh"

        if not self.short:
            seq = last_seq(self.client)
            if not self.step("reboot (reset)", self.reboot):
                return self.results
            self.step("reboot: workspace kept", workspace)
            self.step("reboot: re-enrollment", lambda: self.reenrolled([cvm], seq))
        seq = last_seq(self.client)
        if not self.step("stop and start", self.stop_and_start):
            return self.results

        def after_start() -> str:
            kept = workspace()
            return "; ".join(
                (kept, self.reenrolled(list(self.restarted()), seq), self.request_again())
            )

        self.step("stop and start: re-enrollment, workspace, a request", after_start)
        return self.results


def run_check(
    stack: Stack, client: httpx.Client, cvm_id: str, secret: str, report: Report, short: bool
) -> list[StepResult]:
    if not cvm_id:
        raise UpError("no Dev CVM to check", "run `umbra up --runtime qemu` first")
    return Walkthrough(stack, client, cvm_id, secret, report, short).run()
