"""Every refusal of `umbra ssh-proxy`: exit 1, one line on stderr naming the failed check, no
traceback, nothing on stdout, and not one SSH byte relayed (the proxy reads stdin only after
verification)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.session import harness
from tests.session.conftest import Developer
from umbra.attest.atls import ATLSConnection, serve_atls
from umbra.attest.measurement import SSH_KEYS_EVENT, ssh_keys_digest
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx
from umbra.cli.ssh_config import ssh_argv
from umbra.contracts.session import BOOT_ID_EVENT, CVM_ID_EVENT, SSH_HOST_KEY_EVENT

BANNER = b"SSH-2.0-OpenSSH_9.2p1\r\n"


@pytest.fixture(scope="module")
def box() -> Iterator[harness.Sandbox]:
    harness.require_tools()
    with harness.sandbox() as sandbox:
        yield sandbox


@pytest.fixture(scope="module")
def ingresses(
    developer: Developer,
    box: harness.Sandbox,
    pki_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Any]]:
    """CVM `a` (the one under test) and CVM `b` (another of the developer's CVMs)."""
    a = developer.create_cvm(harness.unique_name())
    b = developer.create_cvm(harness.unique_name())
    with (
        harness.ingress(box, tmp_path_factory.mktemp("a"), a, [developer.pub], pki_dir) as ia,
        harness.ingress(box, tmp_path_factory.mktemp("b"), b, [developer.pub], pki_dir) as ib,
    ):
        yield {"a": a, "b": b, "ia": ia, "ib": ib}


@pytest.fixture
def a(developer: Developer, ingresses: dict[str, Any]) -> Iterator[str]:
    cvm_id: str = ingresses["a"]
    developer.record(cvm_id, port=ingresses["ia"].port, release=harness.release_manifest())
    yield cvm_id
    developer.record(
        cvm_id,
        port=ingresses["ia"].port,
        release=harness.release_manifest(),
        state="running",
        ssh_keys=[developer.pub],
    )


def proxy(
    developer: Developer, cvm_id: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "umbra.cli.ssh_proxy", cvm_id],
        input=BANNER, capture_output=True, env=env or developer.env, timeout=60,
    )  # fmt: skip


def assert_refused(done: subprocess.CompletedProcess[bytes], cvm_id: str, check: str) -> str:
    err = done.stderr.decode()
    assert done.returncode == 1, err
    assert done.stdout == b"", "bytes reached ssh after a refusal"
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"umbra ssh-proxy: refused {cvm_id}: {check}: "), lines[0]
    return lines[0]


def test_the_right_cvm_passes(developer: Developer, a: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "umbra.cli.ssh_proxy", a],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=developer.env,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(BANNER)
        proc.stdin.flush()
        assert proc.stdout.readline().startswith(b"SSH-2.0-OpenSSH"), "the gateway sshd answered"
    finally:
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0


def test_wrong_release(developer: Developer, a: str, ingresses: dict[str, Any]) -> None:
    developer.record(a, port=ingresses["ia"].port, release=harness.release_manifest("umbra-other"))
    assert "MRTD" in assert_refused(proxy(developer, a), a, "release")


def test_wrong_rtmr(developer: Developer, a: str, ingresses: dict[str, Any]) -> None:
    developer.record(
        a, port=ingresses["ia"].port, release=harness.release_manifest(rtmr2=["00" * 48])
    )
    assert "RTMR2" in assert_refused(proxy(developer, a), a, "measurement")


def test_another_cvms_quote(developer: Developer, a: str, ingresses: dict[str, Any]) -> None:
    # the Console (or the network) points a's name at b's ingress: b's quote names b
    developer.record(a, port=ingresses["ib"].port, release=harness.release_manifest())
    assert_refused(proxy(developer, a), a, "cvm-id")


def test_keys_not_bound_at_launch(
    developer: Developer, a: str, ingresses: dict[str, Any], tmp_path: Path
) -> None:
    _, other = harness.keypair(tmp_path, "other")
    port = ingresses["ia"].port
    developer.record(a, port=port, release=harness.release_manifest(), ssh_keys=[other])
    assert_refused(proxy(developer, a), a, "authorized-keys")
    developer.record(a, port=port, release=harness.release_manifest(), ssh_keys=[])
    assert_refused(proxy(developer, a), a, "launch-data")


def test_cvm_stopped(developer: Developer, a: str, ingresses: dict[str, Any]) -> None:
    developer.record(
        a, port=ingresses["ia"].port, release=harness.release_manifest(), state="stopped"
    )
    assert_refused(proxy(developer, a), a, "cvm-state")


def test_console_unreachable(developer: Developer, a: str, tmp_path: Path) -> None:
    config = tmp_path / "config"
    (config / "umbra").mkdir(parents=True)
    port = harness.free_port()
    (config / "umbra" / "console.json").write_text(
        f'{{"url": "http://127.0.0.1:{port}", "token": "t"}}'
    )
    env = {**developer.env, "XDG_CONFIG_HOME": str(config)}
    assert_refused(proxy(developer, a, env), a, "console")


def test_simulated_tee_needs_an_explicit_opt_in(developer: Developer, a: str) -> None:
    env = {k: v for k, v in developer.env.items() if k != "UMBRA_SIMULATED_PKI"}
    assert_refused(proxy(developer, a, env), a, "simulated")


def test_via_the_umbra_command_too(developer: Developer, a: str, ingresses: dict[str, Any]) -> None:
    developer.record(
        a, port=ingresses["ia"].port, release=harness.release_manifest(), state="stopped"
    )
    done = subprocess.run(
        [str(Path(sys.executable).parent / "umbra"), "ssh-proxy", a],
        input=BANNER, capture_output=True, env=developer.env, timeout=60,
    )  # fmt: skip
    assert_refused(done, a, "cvm-state")


class _Replaying:
    """A compromised ingress: answers every session with the quote of the first one."""

    simulated = True

    def __init__(self, tdx: SimulatedTdx) -> None:
        self.tdx = tdx
        self.first: bytes | None = None

    def get_quote(self, report_data: bytes) -> bytes:
        if self.first is None:
            self.first = self.tdx.quote(report_data)
        return self.first


def test_replayed_quote(developer: Developer, a: str, pki_dir: Path) -> None:
    tdx = SimulatedTdx(SimulatedPki.load(pki_dir), image=harness.IMAGE)
    tdx.extend_runtime_event(CVM_ID_EVENT, a.encode())
    tdx.extend_runtime_event(SSH_KEYS_EVENT, ssh_keys_digest([developer.pub]))
    host_key = developer.pub.rsplit(" ", 1)[0].encode()  # any key: sshd is never reached
    tdx.extend_runtime_event(BOOT_ID_EVENT, os.urandom(16).hex().encode())
    tdx.extend_runtime_event(SSH_HOST_KEY_EVENT, host_key)
    received: list[bytes] = []

    async def handler(conn: ATLSConnection) -> None:
        while data := await conn.recv():
            received.append(data)

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    port = harness.free_port()
    server = asyncio.run_coroutine_threadsafe(
        serve_atls(
            "127.0.0.1",
            port,
            handler,
            _Replaying(tdx),
            event_log=tdx.event_log,
            bind=lambda: host_key,
        ),
        loop,
    ).result()
    try:
        developer.record(a, port=port, release=harness.release_manifest())
        first = proxy(developer, a)
        assert first.returncode == 0, first.stderr  # the genuine first session
        received.clear()
        line = assert_refused(proxy(developer, a), a, "freshness")
        assert "replayed" in line
        assert received == []
    finally:
        loop.call_soon_threadsafe(server.close)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


def _known_hosts(developer: Developer) -> Path:
    return Path(developer.env["XDG_CONFIG_HOME"]) / "umbra" / "ssh" / "known_hosts"


def test_a_host_key_swapped_after_boot_is_refused_before_sshd_starts(
    developer: Developer, box: harness.Sandbox, pki_dir: Path, tmp_path: Path
) -> None:
    cvm_id = developer.create_cvm(harness.unique_name())
    sshd, starts = harness.counting_sshd(tmp_path)
    with harness.ingress(box, tmp_path, cvm_id, [developer.pub], pki_dir, sshd=str(sshd)) as ing:
        developer.record(cvm_id, port=ing.port, release=harness.release_manifest())
        assert proxy(developer, cvm_id).returncode == 0  # boot key K1: pinned with this boot
        assert harness.sshd_starts(starts) == 1
        pin = next(
            line.split()
            for line in _known_hosts(developer).read_text().splitlines()
            if line.startswith(f"umbra-{cvm_id} ")
        )
        assert pin[3].startswith("umbra-boot=")
        # after boot, the gateway's key file is swapped for K2
        key = ing.state_dir / "ssh_host_ed25519_key"
        key.unlink()
        key.with_suffix(".pub").unlink()
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
        line = assert_refused(proxy(developer, cvm_id), cvm_id, "host-key-binding")
        assert "changed after boot" in line
        os.environ.update(
            {k: v for k, v in developer.env.items() if k.startswith(("UMBRA_", "XDG_"))}
        )
        done = subprocess.run(
            [*ssh_argv(cvm_id, reuse=False), "echo should-not-run"],
            capture_output=True, text=True, env=developer.env, timeout=60,
        )  # fmt: skip
        assert done.returncode == 255 and "should-not-run" not in done.stdout
        assert f"umbra ssh-proxy: refused {cvm_id}: host-key-binding: " in done.stderr
        assert "Host key verification failed" not in done.stderr  # refused before SSH began
        # the gateway never started sshd: not one SSH byte (not even its banner) was exchanged
        assert harness.sshd_starts(starts) == 1
        assert pin == next(
            line.split()
            for line in _known_hosts(developer).read_text().splitlines()
            if line.startswith(f"umbra-{cvm_id} ")
        )
    # a legitimate relaunch: a new boot binds the key it finds (K2) and gets a new boot id
    with harness.ingress(box, tmp_path, cvm_id, [developer.pub], pki_dir, sshd=str(sshd)) as ing:
        developer.record(cvm_id, port=ing.port, release=harness.release_manifest())
        done_ok = proxy(developer, cvm_id)
        notice = done_ok.stderr.decode()
        assert done_ok.returncode == 0, notice
        assert "restarted" in notice and "pinned its attested host key" in notice
        new_pin = next(
            line.split()
            for line in _known_hosts(developer).read_text().splitlines()
            if line.startswith(f"umbra-{cvm_id} ")
        )
        assert new_pin[1:3] != pin[1:3] and new_pin[3] != pin[3]
        assert harness.sshd_starts(starts) == 2
        # the same boot attesting another key than its pin (a cloned or forged boot) is refused
        forged = harness.keypair(tmp_path, "forged")[1].split()
        _known_hosts(developer).write_text(f"umbra-{cvm_id} {forged[0]} {forged[1]} {new_pin[3]}\n")
        assert_refused(proxy(developer, cvm_id), cvm_id, "host-key-pin")
        assert harness.sshd_starts(starts) == 2


def test_no_default_cvm_among_several(developer: Developer, ingresses: dict[str, Any]) -> None:
    done = developer.umbra("ssh", "--no-reuse", "--", "true")
    assert done.returncode == 2
    assert "pass a CVM name or --cvm" in done.stderr
    assert ingresses["a"] in done.stderr and ingresses["b"] in done.stderr


def test_the_fast_proxy_refuses_with_the_same_line(
    developer: Developer, a: str, ingresses: dict[str, Any]
) -> None:
    from umbra.cli.ssh_config import FAST_PROXY

    developer.record(a, port=ingresses["ia"].port, release=harness.release_manifest("umbra-other"))
    done = subprocess.run(
        [sys.executable, "-S", "-I", str(FAST_PROXY), a],
        input=BANNER, capture_output=True, env=developer.env, timeout=60,
    )  # fmt: skip
    assert "MRTD" in assert_refused(done, a, "release")
    os.environ.update({k: v for k, v in developer.env.items() if k.startswith(("UMBRA_", "XDG_"))})
    via_ssh = subprocess.run(
        [*ssh_argv(a, reuse=False), "echo should-not-run"],
        capture_output=True, text=True, env=developer.env, timeout=60,
    )  # fmt: skip
    assert via_ssh.returncode == 255 and "should-not-run" not in via_ssh.stdout
    assert f"umbra ssh-proxy: refused {a}: release: " in via_ssh.stderr


def test_an_unreachable_notify_socket_stops_the_ingress_saying_why(
    box: harness.Sandbox, pki_dir: Path, tmp_path: Path
) -> None:
    """Under a Type=notify unit whose socket cannot be reached, the ingress says so and exits
    (before: `cannot listen`, though it listened), rather than serve while systemd waits."""
    key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl a"
    config = harness.write_ingress_config(
        box, tmp_path, "cvm_notify", [key], pki_dir, harness.free_port()
    )
    gone = f"@umbra-test-no-such-notify-{os.getpid()}"
    done = subprocess.run(
        [str(Path(sys.executable).parent / "umbra"), "sandbox", "ingress", "--config", str(config)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "NOTIFY_SOCKET": gone},
    )  # fmt: skip
    said = " ".join(done.stderr.split())
    assert done.returncode == 1, done.stderr
    assert f"listening, but cannot tell systemd it is ready (NOTIFY_SOCKET '{gone}'" in said
    assert "cannot listen" not in said
