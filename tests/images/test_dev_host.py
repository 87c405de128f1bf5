"""A cloud Dev CVM's host side, started on this machine as the launch agent starts it on a CVM:
`umbra sandbox host up` on a measured dev-cvm.json. The same sandbox as `umbra up` (runc, the
cached mmdebstrap image, local_cvm's namespaces) and the real forwarder, which attests a
simulated Security CVM (a stand-in tunnel endpoint on the host end of the forwarder's uplink)
before a sandbox byte goes through. Then the supervisor restarts a killed forwarder, `status`
and `down` report and stop it, and a definition this machine cannot honour starts nothing.

What is not run here: TDX (the forwarder's config is the simulated release's, its credential
seeded as if enrolled, since nothing here can quote), the host firewall (its own test,
tests/infra/test_host_firewall.py), the OS image's shipped copy of the image (the cache has the
same layout), cgroup v2 delegation (this host is hybrid v1).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from umbra.attest.atls import ATLSConnection, serve_atls
from umbra.attest.quote_source import SimulatedSource
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx
from umbra.contracts.tunnel_header import (
    MAX_ENV_REPLY,
    TunnelHeader,
    encode_ca_reply,
    encode_env_reply,
    read_header,
)
from umbra.images.measure import instance_events, measure
from umbra.sandbox import image, local_cvm
from umbra.sandbox.dev_definition import host_document, network, plan_for
from umbra.sandbox.dev_host import SUPERVISOR
from umbra.sandbox.local_cvm import LocalCvmError
from umbra.sandbox.render import CA_NAME, canonical_json

from ..certs import self_signed
from ..sandbox.fixtures import dev_definition, security_definition
from ..sandbox.login_shells import LOGIN_SHELLS, login_shells_see, pam_env_assignments

pytestmark = pytest.mark.timeout(900)

UMBRA = str(Path(sys.executable).parent / "umbra")
CREDENTIAL = "dev-host-credential-0123456789"


def _require() -> None:
    if os.geteuid() != 0:
        pytest.skip("LOUD SKIP: the dev host needs root (namespaces, runc)")
    for tool in ("runc", "ip", "nft", "nsenter", "mmdebstrap", "npm"):
        if shutil.which(tool) is None:
            pytest.skip(f"LOUD SKIP: missing {tool}: scripts/system-deps installs it")


def _free_index() -> int:
    """A subnet index no local CVM (or other test) on this machine uses: the dev host takes
    index 1 on a CVM, where it is alone."""
    shown = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True)
    used = {int(w.split(".")[2]) for w in shown.stdout.split() if w.startswith("10.232.")}
    return next(i for i in range(249, 100, -1) if i not in used)


def _interception_ca() -> bytes:
    return self_signed("dev host test interception CA", ca=True).cert_pem


@dataclass
class SecurityCvm:
    """The tunnel endpoint's stand-in: records each identity header, echoes with it, and hands
    out its interception CA (`ca` mode) as the Security CVM does."""

    headers: list[TunnelHeader] = field(default_factory=list)
    ca: bytes = field(default_factory=_interception_ca)
    # The `env` answer's exact bytes (the attached profiles' `sandbox_env`): tests swap it.
    env_reply: bytes = field(default_factory=lambda: encode_env_reply({}))

    async def handle(self, conn: ATLSConnection) -> None:
        header, rest = await read_header(conn.recv)
        self.headers.append(header)
        if header.mode == "ca":
            await conn.send(encode_ca_reply(self.ca))
            return
        if header.mode == "env":
            await conn.send(self.env_reply)
            return
        if header.mode != "proxy":
            return
        data = rest or await conn.recv()
        await conn.send(f"proxy saw {header.cvm_id}/{header.mode}: ".encode() + data)


class HostLoop:
    """An asyncio loop on a thread in this (the host's) network namespace."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@dataclass
class Cvm:
    root: Path
    definition: Path
    cvm_id: str
    index: int
    sec: SecurityCvm

    @property
    def plan(self) -> local_cvm.LocalCvmPlan:
        return plan_for(self.cvm_id, self.index, self.root)

    def host(
        self, command: str, *extra: str, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [UMBRA, "sandbox", "host", command, "--definition", str(self.definition),
             "--root", str(self.root), "--image-dir", str(image.cache_root()), *extra],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        if check:
            assert done.returncode == 0, f"host {command}: {done.stdout}\n{done.stderr}"
        return done


def _definition(tmp: Path, cvm_id: str, index: int, pki: SimulatedPki) -> Path:
    """The measured document as `umbra image measure` renders it, at a free index, with the
    forwarder's launch-bound files in `tmp` (as the launch agent writes them on a CVM)."""
    sec = measure(security_definition())
    d = dev_definition(
        security_cvm={"host": "security-cvm.umbra.internal", "port": 8443},
        security_cvm_release=sec.release.model_dump(mode="json", exclude_none=True),
        allow_simulated=True,
        tunnels=[],
    )
    doc = host_document(d.host, index)
    launch = tmp / "launch"
    launch.mkdir(mode=0o700)
    (launch / "cvm-id").write_text(cvm_id + "\n")
    (launch / "security-cvm-ips").write_text(network(index).host + "\n")
    (launch / "collateral.json").write_text(pki.collateral(int(time.time()) - 60).json_text)
    (launch / "simulated-root.der").write_bytes(pki.root_der)
    # Seeded as if enrolled: nothing here quotes with TDX (the enrollment has its own tests).
    (tmp / "credential").write_text(CREDENTIAL + "\n")
    (tmp / "credential").chmod(0o600)
    root = tmp / "cvm"
    doc["forwarder"].update(
        cvm_id_file=str(launch / "cvm-id"),
        security_cvm_ips_file=str(launch / "security-cvm-ips"),
        collateral={"file": str(launch / "collateral.json")},
        simulated_root=str(launch / "simulated-root.der"),
        credential_file=str(tmp / "credential"),
        sandbox_ca={"file": str(root / "sandbox-ca" / CA_NAME)},
        sandbox_env=local_cvm.sandbox_env_config(plan_for(cvm_id, index, root)),
    )
    path = launch / "dev-cvm.json"
    path.write_text(canonical_json(doc))
    return path


@pytest.fixture(scope="module")
def cvm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cvm]:
    _require()
    image.ensure_image()  # cached per machine (the lead's pre-build): the OS image ships a copy
    tmp = tmp_path_factory.mktemp("devhost")
    pki = SimulatedPki.generate()
    index, cvm_id = _free_index(), f"cvm_{os.urandom(8).hex()}"
    definition = _definition(tmp, cvm_id, index, pki)
    cvm = Cvm(tmp / "cvm", definition, cvm_id, index, SecurityCvm())
    tdx = SimulatedTdx(pki, image="umbra-security-cvm")
    for e in measure(security_definition()).events() + instance_events("security-cvm", "sec-1"):
        tdx.extend_runtime_event(e.name, e.payload)
    loop = HostLoop()
    try:
        up = cvm.host("up", "--json")
        state = json.loads(up.stdout)
        assert state["sandbox_pid"] and state["forwarder_pid"] and state["supervisor_pid"]
        # The Security CVM's address is the host end of the uplink, which `up` just made.
        loop.run(
            serve_atls(network(index).host, 8443, cvm.sec.handle, SimulatedSource(tdx),
                       event_log=tdx.event_log)
        )  # fmt: skip
        yield cvm
    finally:
        cvm.host("down", check=False)
        loop.stop()
        local_cvm.stop_sandbox(cvm.plan)  # unmounts even if `down` failed
        shutil.rmtree(tmp, ignore_errors=True)


def _in_sandbox(cvm: Cvm, script: str) -> subprocess.CompletedProcess[str]:
    return local_cvm.run_in_sandbox(cvm.plan, ["python3", "-c", script], "dev", timeout=60)


EXCHANGE = """
import socket, sys
s = socket.create_connection((sys.argv[1] if len(sys.argv) > 1 else "{addr}", 3128), timeout=20)
s.sendall(b"hello from the sandbox\\n")
print(s.recv(4096).decode(), end="")
"""


def test_the_sandbox_reaches_the_security_cvm_only_through_the_attested_forwarder(
    cvm: Cvm,
) -> None:
    plan = cvm.plan
    done = _in_sandbox(cvm, EXCHANGE.format(addr=plan.forwarder_addr))
    log = (plan.dir / "forwarder.log").read_text(errors="replace")[-1500:]
    assert done.returncode == 0, done.stderr + log
    assert done.stdout == f"proxy saw {cvm.cvm_id}/proxy: hello from the sandbox\n", log
    header = [h for h in cvm.sec.headers if h.mode == "proxy"][-1]
    assert header.credential == CREDENTIAL and header.cvm_id == cvm.cvm_id
    # The same resolver as `umbra up`: every name is the forwarder's sandbox-side address.
    names = _in_sandbox(cvm, "import socket; print(socket.gethostbyname('deb.debian.org'))")
    assert names.stdout.strip() == plan.forwarder_addr, names.stderr
    # Nothing else: not the uplink, not the host end of it (where the Security CVM listens).
    for target in (plan.uplink_addr, plan.host_addr):
        probe = f"import socket; socket.create_connection(({target!r}, 8443), timeout=3)"
        assert _in_sandbox(cvm, probe).returncode != 0


def test_the_forwarder_runs_as_an_unprivileged_uid_once_bound(cvm: Cvm) -> None:
    """Started as host root (enrollment, the credential, the bind), the forwarder then runs as
    its own uid: every id that uid, no groups, no capabilities, no_new_privs. It still works
    after the drop: it relays (the test above) and writes the CA it attests into the sandbox's
    CA directory, which the sandbox installs; the credential file stays root's 0600."""
    plan = cvm.plan
    pid = local_cvm.running_pid(plan, "forwarder")
    assert pid is not None
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    uid = str(plan.forwarder_uid)
    assert plan.forwarder_uid not in (0, plan.uid)
    assert status["Uid"].split() == [uid] * 4 and status["Gid"].split() == [uid] * 4
    assert status["Groups"].strip() == ""
    assert int(status["CapEff"], 16) == 0 and int(status["CapPrm"], 16) == 0
    assert status["NoNewPrivs"].strip() == "1"
    bundle = plan.dir / "sandbox-ca" / CA_NAME
    installed = plan.rootfs / local_cvm.CA_INSTALLED.lstrip("/")
    end = time.monotonic() + 90
    while time.monotonic() < end and not (
        bundle.exists() and bundle.read_bytes() == cvm.sec.ca and installed.exists()
    ):
        time.sleep(0.5)
    log = (plan.dir / "forwarder.log").read_text(errors="replace")[-800:]
    assert bundle.exists() and bundle.read_bytes() == cvm.sec.ca, log
    assert bundle.stat().st_uid == plan.forwarder_uid
    assert installed.exists(), "the sandbox did not install the CA the forwarder wrote"
    credential = Path(json.loads((plan.dir / "forwarder.json").read_text())["credential_file"])
    assert credential.stat().st_uid == 0 and credential.stat().st_mode & 0o777 == 0o600


def _session_env(cvm: Cvm, name: str) -> str:
    """`name` as a new session sees it: the attested ingress's ForceCommand and run_argv alike
    enter the sandbox with an empty environment and run a login shell (/etc/profile.d)."""
    done = local_cvm.run_in_sandbox(cvm.plan, ["bash", "-c", f'echo "${{{name}-unset}}"'])
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _wait_session_env(cvm: Cvm, name: str, want: str, within: float = 30) -> float:
    start = time.monotonic()
    while (got := _session_env(cvm, name)) != want:
        log = (cvm.plan.dir / "forwarder.log").read_text(errors="replace")[-800:]
        assert time.monotonic() - start < within, f"{name} is {got!r}, not {want!r}: {log}"
        time.sleep(0.2)
    return time.monotonic() - start


def _env_asks(cvm: Cvm) -> int:
    return sum(1 for h in cvm.sec.headers if h.mode == "env")


def _two_more_asks(cvm: Cvm) -> None:
    """Until the forwarder has asked twice more: the first of them was answered and handled
    (its loop asks again only after writing, or refusing, the last answer)."""
    before, end = _env_asks(cvm), time.monotonic() + 30
    while _env_asks(cvm) < before + 2:
        assert time.monotonic() < end, "the forwarder stopped asking for the sandbox environment"
        time.sleep(0.2)


PLACEHOLDER = "umbra-placeholder:personal/claude-oauth-token"


def test_the_profiles_sandbox_env_reaches_new_sessions_within_the_poll_interval(
    cvm: Cvm,
) -> None:
    """The cloud host's forwarder asks the (simulated) Security CVM for the attached profiles'
    `sandbox_env` inside an attested session every 3 s, as `umbra up`'s does, and a new session
    has it: an attach, a changed value and a detach each reach the next login shell within the
    poll interval (plus the attested fetch and a session's start). The CVM's values stay."""
    plan = cvm.plan
    config = json.loads((plan.dir / "forwarder.json").read_text())["sandbox_env"]
    refresh = config.get("refresh", 3.0)
    assert _session_env(cvm, "CLAUDE_CODE_OAUTH_TOKEN") == "unset"
    cvm.sec.env_reply = encode_env_reply(
        {"CLAUDE_CODE_OAUTH_TOKEN": PLACEHOLDER, "AWS_REGION": "eu-west-1", "Q": "it's $HOME"}
    )
    attach = _wait_session_env(cvm, "CLAUDE_CODE_OAUTH_TOKEN", PLACEHOLDER)
    # Quoting survives the file: the value is what the profile said, not what a shell made of it.
    assert _session_env(cvm, "Q") == "it's $HOME"
    cvm.sec.env_reply = encode_env_reply(
        {"CLAUDE_CODE_OAUTH_TOKEN": PLACEHOLDER, "AWS_REGION": "us-east-1"}
    )
    change = _wait_session_env(cvm, "AWS_REGION", "us-east-1")
    cvm.sec.env_reply = encode_env_reply({})
    detach = _wait_session_env(cvm, "CLAUDE_CODE_OAUTH_TOKEN", "unset")
    print(
        f"cloud dev host: sandbox_env in a new session {attach:.1f} s after the attach, "
        f"{change:.1f} s after a change, {detach:.1f} s after the detach (poll {refresh:.0f} s)"
    )
    # One poll, the attested fetch and a session's start: never a second poll's worth late.
    assert max(attach, change, detach) < 2 * refresh + 5
    assert _session_env(cvm, "HTTPS_PROXY") == plan.proxy_url
    env_file = plan.dir / "sandbox-etc" / "sandbox.env"
    assert env_file.stat().st_uid == plan.forwarder_uid  # written after the drop, as its uid


def test_su_and_sudo_login_shells_read_the_current_sandbox_env(cvm: Cvm) -> None:
    """Login shells inside the sandbox (`sudo -i`, `su - dev`, a new `bash -l`) read the
    sandbox.env of now (profile.d), and nothing else sets it: a value set, changed and removed
    after the sandbox started is exactly what each of them sees."""
    name = "UMBRA_LOGIN_PROBE"
    # PAM's own file holds no start-time copy that pam_env would apply before the profile (a
    # variable removed since would outlive its detach in su/sudo sessions).
    assert pam_env_assignments(cvm.plan) == "0"
    for value in ("one", "two", None):
        cvm.sec.env_reply = encode_env_reply({name: value} if value else {})
        _wait_session_env(cvm, name, value or "unset")
        want = value or "unset"
        assert login_shells_see(cvm.plan, name) == dict.fromkeys(LOGIN_SHELLS, want), value


BAD_ENV_ANSWERS = {
    "PATH": (encode_env_reply({"PATH": "/tmp/evil"}), "PATH is set by the sandbox itself"),
    "LD_PRELOAD": (
        encode_env_reply({"AWS_REGION": "x", "LD_PRELOAD": "/tmp/evil.so"}),
        "LD_PRELOAD is set by the sandbox itself",
    ),
    "HTTPS_PROXY": (
        encode_env_reply({"HTTPS_PROXY": "http://198.51.100.9:3128"}),
        "HTTPS_PROXY is set by the sandbox itself",
    ),
    "a name a shell would run": (
        encode_env_reply({"X=$(touch /tmp/pwned)": "1"}),
        "does not match",
    ),
    "a newline": (
        encode_env_reply({"AWS_REGION": "x\nPATH=/tmp/evil"}),
        "AWS_REGION: contains a control character",
    ),
    "not JSON": (b"\x00\x00\x00\x05{nope", "env reply is not JSON"),
    "oversized": (
        (MAX_ENV_REPLY + 1).to_bytes(4, "big") + b"{" * 4096,
        f"env reply length {MAX_ENV_REPLY + 1} is outside",
    ),
}


def test_a_bad_env_answer_is_refused_whole_and_the_last_one_stays(cvm: Cvm) -> None:
    """The forwarder checks the Security CVM's answer against the names the sandbox owns (the
    linter's rule, contracts/sandbox_env.py) before a byte reaches `sandbox.env`: a malformed,
    oversized or forbidden answer is refused whole with one log line saying why, and sessions
    keep the last attested environment. The refused values are never logged."""
    plan = cvm.plan
    good = encode_env_reply({"CLAUDE_CODE_OAUTH_TOKEN": PLACEHOLDER})
    cvm.sec.env_reply = good
    _wait_session_env(cvm, "CLAUDE_CODE_OAUTH_TOKEN", PLACEHOLDER)
    env_file = plan.dir / "sandbox-etc" / "sandbox.env"
    kept = env_file.read_bytes()
    log_path = plan.dir / "forwarder.log"
    for case, (answer, reason) in BAD_ENV_ANSWERS.items():
        offset = log_path.stat().st_size
        cvm.sec.env_reply = answer
        _two_more_asks(cvm)
        log = log_path.read_bytes()[offset:].decode(errors="replace")
        assert reason in log and "keeping the last attested one" in log, (case, log)
        assert b"evil" not in log_path.read_bytes()[offset:], case
        assert env_file.read_bytes() == kept, case
    assert _session_env(cvm, "CLAUDE_CODE_OAUTH_TOKEN") == PLACEHOLDER
    assert _session_env(cvm, "LD_PRELOAD") == "unset"
    assert _session_env(cvm, "PATH").split(":")[0] != "/tmp/evil"
    # A good answer is taken again at once.
    cvm.sec.env_reply = encode_env_reply({})
    _wait_session_env(cvm, "CLAUDE_CODE_OAUTH_TOKEN", "unset")


def test_status_reports_the_measured_release_and_every_process(cvm: Cvm) -> None:
    state = json.loads(cvm.host("status").stdout)
    assert state["release"] == "dev-cvm-test" and state["runtime"] == "runc"
    assert state["sandbox_image"] == {
        "recipe_key": image.recipe_key(),
        "files_key": image.files_key(),
    }
    assert all(state[k] for k in ("sandbox_pid", "forwarder_pid", "supervisor_pid"))
    # The attested ingress enters the sandbox through runc's own pid file.
    assert int((cvm.root / "sandbox.pid").read_text()) == state["sandbox_pid"]


def test_the_supervisor_restarts_a_dead_forwarder_and_sandbox(cvm: Cvm) -> None:
    plan = cvm.plan
    before = local_cvm.running_pid(plan, "forwarder")
    assert before is not None
    with contextlib.suppress(ProcessLookupError):
        os.killpg(before, signal.SIGKILL)
    sandbox_before = local_cvm.running_pid(plan, "sandbox")
    subprocess.run(["runc", "--root", str(plan.dir / "runc"), "kill", plan.cvm_id, "KILL"],
                   capture_output=True, timeout=30)  # fmt: skip
    end = time.monotonic() + 90
    while time.monotonic() < end:
        fwd, sbx = (local_cvm.running_pid(plan, r) for r in ("forwarder", "sandbox"))
        if fwd not in (None, before) and sbx not in (None, sandbox_before):
            break
        time.sleep(0.5)
    else:
        log = (plan.dir / "supervisor.log").read_text(errors="replace")[-800:]
        pytest.fail(f"the supervisor did not restart them: {log}")
    local_cvm.wait_role_listening(
        plan, "forwarder", plan.forwarder_ns, plan.forwarder_addr, 3128, timeout=60
    )
    done = _in_sandbox(cvm, EXCHANGE.format(addr=plan.forwarder_addr))
    assert done.stdout.startswith(f"proxy saw {cvm.cvm_id}/proxy"), done.stderr


def test_a_definition_this_cvm_cannot_honour_starts_nothing(cvm: Cvm, tmp_path: Path) -> None:
    doc = json.loads(cvm.definition.read_text())
    doc["sandbox_image"]["files_key"] = "0" * 16
    other = tmp_path / "dev-cvm.json"
    other.write_text(canonical_json(doc))
    bad = Cvm(tmp_path / "cvm", other, cvm.cvm_id, cvm.index, cvm.sec)
    done = bad.host("up", check=False)
    assert done.returncode == 1
    assert "sandbox_image: the release measures" in done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert not (tmp_path / "cvm").exists()
    # An image directory without the measured tree: refused, nothing started.
    empty = Cvm(tmp_path / "cvm", cvm.definition, cvm.cvm_id, cvm.index, cvm.sec)
    done = subprocess.run(
        [UMBRA, "sandbox", "host", "up", "--definition", str(cvm.definition),
         "--root", str(tmp_path / "cvm"), "--image-dir", str(tmp_path / "no-image")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1
    assert "is not a built image tree on this CVM" in done.stdout + done.stderr
    assert not empty.root.exists()


def test_down_stops_everything_and_keeps_the_sandboxs_files(cvm: Cvm) -> None:
    plan = cvm.plan
    marker = "/home/dev/kept-across-down"
    assert _in_sandbox(cvm, f"open({marker!r}, 'w').write('x')").returncode == 0
    cvm.host("down")
    state = json.loads(cvm.host("status").stdout)
    assert state["sandbox_pid"] is None and state["forwarder_pid"] is None
    assert state["supervisor_pid"] is None and state["sandbox_netns"] is None
    assert (plan.dir / "upper" / marker.lstrip("/")).exists()
    # Up again: the same sandbox, its files there.
    cvm.host("up")
    assert _in_sandbox(cvm, f"print(open({marker!r}).read())").stdout.strip() == "x"


def test_a_cvm_stop_sigterm_stops_the_sandbox_and_restarts_nothing(cvm: Cvm) -> None:
    """A CVM's stop as systemd does it: SIGTERM to every process of the launch agent's unit (the
    supervisor and the forwarder's group) at once. The sandbox (in its own runc cgroup, which
    systemd does not signal) must end too, its mounts gone, so the data volume unmounts; the
    supervisor must not restart the forwarder it sees die."""
    plan = cvm.plan
    log = plan.dir / "supervisor.log"
    cvm.host("down")
    offset = log.stat().st_size
    cvm.host("up")  # the signals come while the new supervisor is still starting
    sup, fwd = (local_cvm.running_pid(plan, r) for r in (SUPERVISOR, "forwarder"))
    assert sup is not None and fwd is not None
    os.killpg(fwd, signal.SIGTERM)
    os.kill(sup, signal.SIGTERM)
    end = time.monotonic() + 60
    while local_cvm.running_pid(plan, SUPERVISOR) is not None and time.monotonic() < end:
        time.sleep(0.1)
    said = log.read_bytes()[offset:].decode(errors="replace")
    assert local_cvm.running_pid(plan, SUPERVISOR) is None, said
    assert "umbra-dev-host: stopped" in said and "restarted" not in said, said
    state = json.loads(cvm.host("status").stdout)
    assert state["sandbox_pid"] is None and state["forwarder_pid"] is None, state
    assert plan.cvm_id not in Path("/proc/self/mounts").read_text()
    cvm.host("up")  # the module's CVM, for the tests after this one
    assert all(json.loads(cvm.host("status").stdout)[k] for k in ("sandbox_pid", "forwarder_pid"))


def test_up_waits_out_the_forwarders_boot_enrollment() -> None:
    """The forwarder listens only once enrolled, and at boot it retries an unanswering Console
    for BOOT_RETRY_DELAYS: `up` must wait at least that long, or a launch fails while its
    enrollment is still within budget (60 s did, under the emulated clouds' TCG); and the
    launch agent must wait for `up` longer still."""
    from umbra.attest.enroll_client import BOOT_RETRY_DELAYS
    from umbra.images import launch_ingress, os_image
    from umbra.images.launch_agent import DevHostStart
    from umbra.sandbox import dev_host

    assert sum(BOOT_RETRY_DELAYS) + 60 <= dev_host.FORWARDER_START_TIMEOUT
    host_up = DevHostStart(Path("/r"), Path("/i")).timeout
    assert host_up > dev_host.FORWARDER_START_TIMEOUT
    # The agent's own unit outlasts both of its bounded waits, so they say why, not systemd.
    unit = os_image.UNIT.read_text().splitlines()
    (limit,) = [int(ln.split("=")[1]) for ln in unit if ln.startswith("TimeoutStartSec=")]
    assert limit > host_up + launch_ingress.START_TIMEOUT + 60


def test_a_restarted_forwarder_gets_the_wait_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """`ensure_running` (what `up` and the supervisor call) waits for a forwarder it started as
    long as asked: its own 60 s default is what failed the emulated cloud's boots, before `up`'s
    longer wait was ever reached."""
    waits: list[float] = []
    plan = local_cvm.LocalCvmPlan("cvm_0123456789abcdef", 1, "uxx", "/nonexistent", 200000)
    monkeypatch.setattr(
        local_cvm, "running_pid", lambda _p, role: 1 if role != "forwarder" else None
    )
    monkeypatch.setattr(local_cvm, "start_forwarder", lambda _p: 1)
    monkeypatch.setattr(local_cvm, "wait_role_listening", lambda *a: waits.append(a[-1]))
    assert local_cvm.ensure_running(plan, 421.0) == ["forwarder"]
    assert waits == [421.0]


def test_a_forwarder_that_exits_before_listening_fails_at_once_with_why(tmp_path: Path) -> None:
    """The wait ends when the process does, naming what it said: a forwarder whose enrollment
    was refused is not waited out for its whole budget, and the launch's refusal says why (a
    bare 'nothing listens after 422s' was all an emulated-cloud failure in CI had to go on)."""
    plan = local_cvm.LocalCvmPlan("cvm_0123456789abcdef", 1, "uxx", str(tmp_path), 200000)
    local_cvm._spawn(plan, "forwarder", ["sh", "-c", "echo 'enrollment: refused (403)'; exit 3"])
    with pytest.raises(LocalCvmError) as err:
        local_cvm.wait_role_listening(plan, "forwarder", None, "127.0.0.1", 1, timeout=3600)
    assert "exited before it listened on 127.0.0.1:1" in str(err.value)
    assert "enrollment: refused (403)" in str(err.value)


def test_the_wait_reads_the_process_own_table_in_its_namespace(tmp_path: Path) -> None:
    """A process listening in a namespace of its own is seen through /proc/PID/net/tcp (nothing
    spawned per poll), and the loopback of ours does not count for it."""
    ns = f"uwr{os.getpid() % 100000}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    plan = local_cvm.LocalCvmPlan("cvm_0123456789abcdef", 1, "uxx", str(tmp_path), 200000)
    listen = (
        "import socket, time; s = socket.socket(); s.bind(('127.0.0.1', 3128)); "
        "time.sleep(2); s.listen(); print('listening', flush=True); time.sleep(60)"
    )
    ours = socket.socket()
    ours.bind(("127.0.0.1", 0))
    ours.listen()
    pid = local_cvm._spawn(plan, "forwarder", [
        "ip", "netns", "exec", ns, "sh", "-c", f"ip link set lo up && exec {sys.executable} -c \"{listen}\"",
    ])  # fmt: skip
    try:
        with pytest.raises(LocalCvmError, match="runs but does not listen"):
            local_cvm.wait_role_listening(
                plan, "forwarder", ns, "127.0.0.1", ours.getsockname()[1], 1
            )
        local_cvm.wait_role_listening(plan, "forwarder", ns, "127.0.0.1", 3128, timeout=60)
        assert "listening" in (plan.dir / "forwarder.log").read_text()
    finally:
        os.kill(pid, signal.SIGKILL)
        ours.close()
        subprocess.run(["ip", "netns", "del", ns], check=False)


def test_a_forwarder_that_runs_but_never_listens_fails_at_its_budget(tmp_path: Path) -> None:
    plan = local_cvm.LocalCvmPlan("cvm_0123456789abcdef", 1, "uxx", str(tmp_path), 200000)
    pid = local_cvm._spawn(plan, "forwarder", ["sh", "-c", "echo enrolling; exec sleep 60"])
    try:
        with pytest.raises(LocalCvmError, match=r"runs but does not listen .* after 1s: enrolling"):
            local_cvm.wait_role_listening(plan, "forwarder", None, "127.0.0.1", 1, timeout=1)
    finally:
        os.kill(pid, signal.SIGKILL)
