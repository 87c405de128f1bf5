"""The sandbox image under its runtime (runc), on this machine's real kernel, as root.

One sandbox for the module: the cached image (built once per machine: sandbox/image.py), the
local CVM's topology (sandbox netns -> forwarder netns with its nft filter -> host), and in the
forwarder's place a stand-in: a listener on the forwarder's sandbox-side address relaying to a
real mitmproxy on the host's loopback, with its interception CA handed to the sandbox exactly as
the forwarder hands the Security CVM's (a file bound read-only, installed by the sandbox's init).
The stand-in is this test's seam: the embedded Security CVM resolves only its demo names until
the sandbox-egress part of #21 lands, and apt, pip and npm need the real mirror hosts.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from umbra.sandbox import image, local_cvm, runtime
from umbra.sandbox.render import CA_NAME

ROOT = Path(__file__).resolve().parents[2]
MITMDUMP = ROOT / ".venv" / "bin" / "mitmdump"


def _require() -> None:
    if os.geteuid() != 0:
        pytest.skip("the sandbox runtime needs root (CI runs as root)")
    for tool in ("runc", "mmdebstrap", "npm", "ip", "nft", "nsenter"):
        if shutil.which(tool) is None:
            pytest.skip(f"missing {tool}: scripts/system-deps installs it")


def _listen_in(netns: str, host: str, port: int) -> socket.socket:
    """A listening socket inside `netns` (setns is per thread: only a helper thread moves)."""
    made: list[socket.socket] = []

    def work() -> None:
        fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
        os.setns(fd, os.CLONE_NEWNET)
        os.close(fd)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(64)
        made.append(sock)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    return made[0]


def _pipe(a: socket.socket, b: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := a.recv(65536):
            b.sendall(data)
    with contextlib.suppress(OSError):
        b.shutdown(socket.SHUT_WR)


def _relay(listener: socket.socket, port: int) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        try:
            upstream = socket.create_connection(("127.0.0.1", port), 5)
        except OSError:
            conn.close()
            continue
        for a, b in ((conn, upstream), (upstream, conn)):
            threading.Thread(target=_pipe, args=(a, b), daemon=True).start()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Sandbox:
    def __init__(self, plan: local_cvm.LocalCvmPlan) -> None:
        self.plan = plan

    def run(
        self, script: str, user: str = "dev", timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return local_cvm.run_in_sandbox(self.plan, ["sh", "-c", script], user, timeout)

    def ok(self, script: str, user: str = "dev", timeout: float = 120) -> str:
        done = self.run(script, user, timeout)
        assert done.returncode == 0, (
            f"{script!r}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
        )
        return done.stdout


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sandbox]:
    _require()
    layers = image.ensure_image()  # cached: built once per machine, reused by every later run
    tmp = tmp_path_factory.mktemp("sbx")
    prefix = f"usr{os.getpid() % 100000}"
    plan = local_cvm.allocate(tmp / "cvms", f"cvm_{os.urandom(6).hex()}", prefix)
    mitm_port = _free_port()
    mitm = None
    try:
        local_cvm.create_network(plan, [local_cvm.SANDBOX_PROXY_PORT])
        confdir = tmp / "mitm"
        mitm = subprocess.Popen(
            [str(MITMDUMP), "-q", "--listen-host", "127.0.0.1", "--listen-port", str(mitm_port),
             "--set", f"confdir={confdir}",
             "--set", "ssl_verify_upstream_trusted_ca=/etc/ssl/certs/ca-certificates.crt"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        listener = _listen_in(plan.forwarder_ns, plan.forwarder_addr, local_cvm.SANDBOX_PROXY_PORT)
        threading.Thread(target=_relay, args=(listener, mitm_port), daemon=True).start()
        ca = confdir / "mitmproxy-ca-cert.pem"
        end = time.monotonic() + 30
        while not ca.exists() and time.monotonic() < end:
            time.sleep(0.1)
        (plan.dir / "sandbox-ca").mkdir(mode=0o755)
        shutil.copyfile(ca, plan.dir / "sandbox-ca" / CA_NAME)
        local_cvm.start_sandbox(plan)
        assert local_cvm.sandbox_spec(plan).image == layers
        installed = plan.rootfs / local_cvm.CA_INSTALLED.lstrip("/")
        end = time.monotonic() + 60
        while not installed.exists() and time.monotonic() < end:
            time.sleep(0.2)
        init_log = (plan.dir / "runc" / "init.log").read_text(errors="replace")
        assert installed.exists(), f"the sandbox did not install the CA:\n{init_log}"
        yield Sandbox(plan)
    finally:
        listener_close = locals().get("listener")
        if listener_close is not None:
            listener_close.close()
        if mitm is not None:
            mitm.kill()
            mitm.wait()
        local_cvm.destroy(plan)


def test_the_user_has_sudo_a_writable_etc_and_the_login_environment(sandbox: Sandbox) -> None:
    plan = sandbox.plan
    assert sandbox.ok("id -un; id -u").split() == ["dev", "1000"]
    assert sandbox.ok("sudo -n id -u").strip() == "0"
    sandbox.ok("echo 'umbra-test' | sudo tee -a /etc/motd >/dev/null; grep -q umbra-test /etc/motd")
    env = dict(line.split("=", 1) for line in sandbox.ok("env").splitlines() if "=" in line)
    for key in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        assert env[key] == plan.proxy_url
    assert "localhost" in env["NO_PROXY"] and "localhost" in env["no_proxy"]
    for key in image.CA_VARS:
        assert env[key] == image.CA_BUNDLE
    # sudo keeps them (apt, pip, npm as root go through the same proxy with the same CA).
    root_env = sandbox.ok("sudo env")
    assert f"https_proxy={plan.proxy_url}" in root_env
    assert f"NODE_EXTRA_CA_CERTS={image.CA_BUNDLE}" in root_env
    # A binary the user installs under ~/.local/bin is found by the next session.
    sandbox.ok("mkdir -p ~/.local/bin && printf '#!/bin/sh\\necho mine\\n' > ~/.local/bin/mytool"
               " && chmod +x ~/.local/bin/mytool")  # fmt: skip
    assert local_cvm.run_in_sandbox(plan, ["mytool"]).stdout.strip() == "mine"
    # The resolver is the forwarder's sandbox-side address (a rendered input, not a literal).
    assert f"nameserver {plan.forwarder_addr}" in sandbox.ok("cat /etc/resolv.conf")
    # The Security CVM's CA (here the stand-in's) is in the system store.
    assert "umbra/security-cvm-1.crt" in sandbox.ok("ls -l /etc/ssl/certs/ | grep umbra")


def test_the_agents_and_tools_are_installed(sandbox: Sandbox) -> None:
    out = sandbox.ok(
        "node --version; claude --version; codex --version; git --version; python3 --version;"
        " gcc --version | head -1; docker --version; npm --version"
    )
    assert out.startswith("v22."), out
    assert "Claude Code" in out or "2.1.332" in out, out
    assert "0.171.0" in out, out


def test_sudo_apt_get_install_through_the_proxy(sandbox: Sandbox) -> None:
    sandbox.ok("sudo apt-get install -y -q --no-install-recommends hello >/dev/null", timeout=300)
    assert "Hello, world!" in sandbox.ok("hello")


def test_pip_install_through_the_proxy_with_the_ca(sandbox: Sandbox) -> None:
    sandbox.ok(
        "python3 -m venv /tmp/venv && /tmp/venv/bin/pip install -q --disable-pip-version-check six"
        " && /tmp/venv/bin/python -c 'import six; print(six.__version__)'",
        timeout=300,
    )


def _docker_ready(sandbox: Sandbox) -> None:
    end = time.monotonic() + 60
    while sandbox.run("docker info >/dev/null 2>&1").returncode != 0:
        assert time.monotonic() < end, sandbox.run("sudo tail -20 /var/log/dockerd.log", "root")
        time.sleep(0.5)


# A Debian mirror file, fetched through the proxy (the stand-in's mitmproxy; the machine reaches
# the package mirror and nothing else).
FETCHED = "http://deb.debian.org/debian/dists/trixie/Release"


def test_docker_builds_with_a_network_step_and_runs_the_image_inside(sandbox: Sandbox) -> None:
    """A rootful dockerd in the sandbox (root = an unprivileged host uid) on Docker's own bridge
    and NAT, in the sandbox's network namespace: a build's RUN step fetches through the proxy
    (the forwarder's address, the sandbox's one way out) with no --build-arg, and the built
    image runs. No registry: the image is the sandbox's static busybox."""
    _docker_ready(sandbox)
    out = sandbox.ok(
        "set -e; mkdir -p /tmp/img && cd /tmp/img && cp /bin/busybox . &&"
        " printf 'FROM scratch\\nCOPY busybox /bin/busybox\\n"
        f'RUN ["/bin/busybox", "wget", "-q", "-O", "/fetched", "{FETCHED}"]\\n'
        'CMD ["/bin/busybox", "grep", "-m1", "^Codename:", "/fetched"]\\n\' > Dockerfile &&'
        " docker build -q -t umbra-inner . >/dev/null &&"
        " docker run --rm umbra-inner",
        timeout=300,
    )
    assert out.strip() == "Codename: trixie", out
    # The bridge and the NAT rule are the nested dockerd's, in the sandbox's own namespace.
    assert "docker0" in sandbox.ok("ip -o link show docker0")
    assert "MASQUERADE" in sandbox.ok("sudo iptables -t nat -S POSTROUTING")


def test_nested_containers_get_the_proxy_without_being_told(sandbox: Sandbox) -> None:
    """`docker run` with no -e, as the user and as root: the Docker client's config (written by
    the sandbox's init) hands the container HTTP(S)_PROXY, so busybox's wget reaches the mirror
    through the proxy (without it, the name would not even resolve: no DNS but the forwarder's).
    The daemon itself has the same proxy for its pulls."""
    _docker_ready(sandbox)
    sandbox.ok(
        "set -e; mkdir -p /tmp/plain && cd /tmp/plain && cp /bin/busybox . &&"
        " printf 'FROM scratch\\nCOPY busybox /bin/busybox\\n' > Dockerfile &&"
        " docker build -q -t umbra-plain . >/dev/null",
        timeout=300,
    )
    fetch = f"docker run --rm umbra-plain /bin/busybox wget -q -O - {FETCHED}"
    for user in ("dev", "root"):
        out = sandbox.ok(f"{fetch} | grep -m1 '^Codename:'", user=user, timeout=120)
        assert out.strip() == "Codename: trixie", (user, out)
    env = sandbox.ok("docker run --rm umbra-plain /bin/busybox env")
    assert f"HTTPS_PROXY={sandbox.plan.proxy_url}" in env.splitlines(), env
    info = sandbox.ok("docker info --format '{{.HTTPSProxy}}'")
    assert info.strip() == sandbox.plan.proxy_url, info


def test_strace_works(sandbox: Sandbox) -> None:
    out = sandbox.run("strace -f -e trace=execve true")
    assert out.returncode == 0, out.stderr
    assert "execve(" in out.stderr


def test_pid_1_reaps_orphans(sandbox: Sandbox) -> None:
    """An orphan that exits is reparented to the sandbox's PID 1 (tini), which reaps it; a PID 1
    that does not (the old `sleep infinity`) leaves a zombie for good."""
    assert sandbox.ok("cat /proc/1/comm", "root").strip() == "tini"
    pid = sandbox.ok("sh -c 'sleep 0.3 & echo $!'", "root").strip()
    time.sleep(1.5)
    state = sandbox.run(f"cat /proc/{pid}/stat 2>/dev/null | cut -d' ' -f3", "root").stdout
    assert state.strip() == "", f"orphan {pid} left in state {state!r}"


def test_escapes_are_refused(sandbox: Sandbox) -> None:
    plan = sandbox.plan
    assert sandbox.ok("cat /proc/self/uid_map", "root").split() == ["0", str(plan.uid), "65536"]
    # The host's disk: no device node for it, and none can be made; nothing to mount.
    disk = os.stat("/").st_dev
    major, minor = os.major(disk), os.minor(disk)
    out = sandbox.run(f"mknod /tmp/disk b {major} {minor}; mount /tmp/disk /mnt", "root")
    assert out.returncode != 0 and "Operation not permitted" in out.stderr, out.stderr
    # Loading a module: init_module(2) is refused (EPERM; ENOSYS on a kernel built without
    # module support, such as this machine's, which proves less).
    out = sandbox.run(
        'python3 -c "import ctypes,os; l=ctypes.CDLL(None,use_errno=True);'
        " r=l.syscall(175, None, 0, b''); print(r, os.strerror(ctypes.get_errno()))\"",
        "root",
    )
    assert out.stdout.split()[0] == "-1", out.stdout
    assert "Operation not permitted" in out.stdout or "Function not implemented" in out.stdout
    # Routes: the sandbox's root changes its own namespace's (runc made it, owned by the
    # sandbox's user namespace: nested Docker needs that), never the host's or the forwarder's.
    sandbox.ok(f"ip route add 10.99.0.0/24 dev {plan.ifname('a')}", "root")
    try:
        for ns in ([], ["-n", plan.forwarder_ns]):
            shown = subprocess.run(["ip", *ns, "route"], capture_output=True, text=True).stdout
            assert "10.99.0.0" not in shown, ns
        # The host's namespace is not even nameable from inside: its net ns is not the host's.
        assert os.readlink("/proc/self/ns/net") not in sandbox.ok("readlink /proc/1/ns/net", "root")
    finally:
        sandbox.run("ip route del 10.99.0.0/24", "root")
    # A host-owned key bound into its tree: the sandbox's root cannot read it.
    key = plan.dir / "sandbox-etc" / "host-key"
    key.write_text("host-only-secret\n")
    key.chmod(0o600)
    try:
        out = sandbox.run(f"cat {image.ENV_DIR}/host-key", "root")
        assert out.returncode != 0 and "host-only-secret" not in out.stdout
    finally:
        key.unlink()


def _chrooted(script: str) -> str:
    """`script` in a nested container (its own network namespace behind the sandbox's bridge),
    with the sandbox's tree as its userland (read-only, `chroot`)."""
    quoted = script.replace("'", "'\\''")
    return (
        f"docker run --rm -v /:/host:ro umbra-inner /bin/busybox chroot /host /bin/sh -c '{quoted}'"
    )


def test_nothing_but_the_forwarder_is_reachable(sandbox: Sandbox) -> None:
    """Even with a default route via the forwarder (its root may add one: the namespace is its
    own), the uplink, the host end, the Security CVM's address and UDP/DNS go nowhere, from the
    sandbox and from a nested container; the proxy (the forwarder's address) is reached."""
    plan = sandbox.plan
    _docker_ready(sandbox)
    if sandbox.run("docker image inspect umbra-inner >/dev/null 2>&1").returncode != 0:
        sandbox.ok(
            "mkdir -p /tmp/img2 && cd /tmp/img2 && cp /bin/busybox . &&"
            " printf 'FROM scratch\\nCOPY busybox /bin/busybox\\n' > Dockerfile &&"
            " docker build -q -t umbra-inner . >/dev/null"
        )
    sandbox.ok(f"ip route add default via {plan.forwarder_addr}", "root")
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind((plan.host_addr, 0))
    udp.settimeout(2)
    port = udp.getsockname()[1]
    send_udp = (
        'python3 -c "import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM);'
        f" [s.sendto(b'x', (a, p)) for a in ('{plan.host_addr}', '{plan.uplink_addr}')"
        f' for p in ({port}, 53)]"'
    )
    try:
        for where in ("sandbox", "nested"):
            wrap = _chrooted if where == "nested" else (lambda script: script)
            for addr in (plan.uplink_addr, plan.host_addr, local_cvm.SECURITY_CVM_ADDR):
                out = sandbox.run(wrap(f"curl -sS --noproxy '*' -m 3 http://{addr}:{port}/"))
                assert out.returncode != 0, (where, addr, out.stdout)
            sandbox.run(wrap(send_udp))
            with pytest.raises(TimeoutError):
                udp.recvfrom(16)
            # No resolver answers (this stand-in has no DNS responder): nothing resolves.
            out = sandbox.run(wrap("getent hosts deb.debian.org"), timeout=30)
            assert out.returncode != 0, (where, out.stdout)
            # The one way out works from both: the proxy on the forwarder's address.
            code = sandbox.ok(
                wrap(f"curl -sS -m 20 -x {plan.proxy_url} -o /dev/null -w %{{http_code}} {FETCHED}")
            )
            assert code == "200", (where, code)
    finally:
        udp.close()
        sandbox.run("ip route del default", "root")


def test_the_runtime_leaves_nothing_after_a_stop(sandbox: Sandbox) -> None:
    plan = sandbox.plan
    local_cvm.stop(plan, "sandbox")
    assert local_cvm.running_pid(plan, "sandbox") is None
    assert str(runtime.RUN_ROOT / plan.cvm_id) not in Path("/proc/self/mountinfo").read_text()
    assert not (runtime.RUN_ROOT / plan.cvm_id).exists()
    # Its files survive a stop: the next start finds the package installed earlier.
    local_cvm.start_sandbox(plan)
    assert sandbox.ok("grep -c umbra-test /etc/motd").strip() == "1"
    # The new sandbox has a new network namespace and link; the forwarder's listener, bound
    # before (ip_nonlocal_bind=1 in its namespace), still answers on the new link.
    assert local_cvm.run_in_sandbox(plan, ["ip", "-o", "addr", "show", plan.ifname("a")]).stdout
    code = sandbox.ok(f"curl -sS -m 20 -o /dev/null -w %{{http_code}} {FETCHED}")
    assert code == "200", code
