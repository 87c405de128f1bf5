"""The ingress's configuration and launch checks: precise errors (file, field), fail closed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from umbra.attest.eventlog import dump_dstack_event_log, make_runtime_event
from umbra.contracts.session import BOOT_ID_EVENT, SSH_HOST_KEY_EVENT
from umbra.sandbox.ingress import Ingress
from umbra.sandbox.ingress_config import IngressConfig, IngressConfigError, load_ingress_config


def _config(tmp_path: Path, **over: object) -> dict[str, object]:
    launch = tmp_path / "launch"
    launch.mkdir(exist_ok=True)
    (launch / "cvm-id").write_text("dev-1\n")
    (launch / "authorized_keys").write_text(
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl a@b\n"
    )
    doc: dict[str, object] = {
        "listen": {"host": "127.0.0.1", "port": 2222},
        "launch_dir": str(launch),
        "state_dir": str(tmp_path / "state"),
        "sandbox": {"netns": "uss-none"},
        "quote_source": {"kind": "configfs", "event_log": str(tmp_path / "log.json")},
    }
    doc.update(over)
    return doc


def test_bad_config_names_file_and_field(tmp_path: Path) -> None:
    path = tmp_path / "ingress.json"
    path.write_text(json.dumps(_config(tmp_path, sandbox={"uid": 0}, surprise=1)))
    bad = path.read_text()
    with pytest.raises(IngressConfigError) as err:
        load_ingress_config(path)
    text = str(err.value)
    assert f"{path}: sandbox.uid:" in text and f"{path}: surprise:" in text
    path.write_text(json.dumps(_config(tmp_path, sandbox={})))
    with pytest.raises(
        IngressConfigError, match="sandbox: Value error, give pid, pid_file or netns"
    ):
        load_ingress_config(path)
    path.write_text(bad)
    done = subprocess.run(
        [str(Path(sys.executable).parent / "umbra"), "sandbox", "ingress", "--config", str(path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "sandbox.uid" in done.stderr and "Traceback" not in done.stderr


def test_the_old_docker_target_is_refused(tmp_path: Path) -> None:
    """The old layout's `sandbox.docker` (a compose container looked up by its labels) is gone:
    the sandbox is runc's, found by its pid file; a config naming it is refused by field."""
    pid_file = tmp_path / "sandbox.pid"
    pid_file.write_text(f"{os.getpid()}\n")
    target = {"project": "uca-none", "service": "sandbox"}
    with pytest.raises(ValueError, match="docker"):
        IngressConfig.model_validate(
            _config(tmp_path, sandbox={"pid_file": str(pid_file), "docker": target})
        )


def test_simulated_needs_a_pki_and_only_then(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="simulated_pki"):
        IngressConfig.model_validate(_config(tmp_path, quote_source={"kind": "simulated"}))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the gateway's files are root's")
def test_configfs_refuses_to_start_unless_the_launch_agent_bound_this_host_key(
    tmp_path: Path,
) -> None:
    config = IngressConfig.model_validate(_config(tmp_path))
    log = tmp_path / "log.json"
    log.write_text(dump_dstack_event_log([make_runtime_event(3, "umbra.cvm-id", b"dev-1")]))
    with pytest.raises(IngressConfigError, match="has not bound this host key"):
        Ingress(config)
    # the host key now exists (made at first start); bind another one: still refused
    host = (tmp_path / "state" / "ssh_host_ed25519_key.pub").read_text().split()
    other = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"
    log.write_text(
        dump_dstack_event_log([make_runtime_event(3, SSH_HOST_KEY_EVENT, other.encode())])
    )
    with pytest.raises(IngressConfigError, match="has not bound this host key"):
        Ingress(config)
    bound = f"{host[0]} {host[1]}".encode()
    log.write_text(dump_dstack_event_log([make_runtime_event(3, SSH_HOST_KEY_EVENT, bound)]))
    with pytest.raises(IngressConfigError, match="has not bound a boot id"):
        Ingress(config)
    boot = make_runtime_event(3, BOOT_ID_EVENT, os.urandom(16).hex().encode())
    log.write_text(dump_dstack_event_log([boot, make_runtime_event(3, SSH_HOST_KEY_EVENT, bound)]))
    ingress = Ingress(config)
    assert ingress.host_key == bound.decode()
    state = tmp_path / "state"
    assert oct(state.stat().st_mode & 0o777) == "0o700"
    assert "AllowAgentForwarding no" in (state / "sshd_config").read_text()
    assert "\nHostKey " not in (state / "sshd_config").read_text()  # each sshd: its bound key


def test_a_pid_file_naming_a_host_process_or_none_is_never_entered(tmp_path: Path) -> None:
    """A stale PID file (the sandbox container restarted, its number reused by a host process)
    must not put a session into the host's namespaces: checked per connection, before sshd."""
    from umbra.sandbox.gateway_sshd import netns_path

    pid_file = tmp_path / "sandbox.pid"
    config = IngressConfig.model_validate(_config(tmp_path, sandbox={"pid_file": str(pid_file)}))
    pid_file.write_text(f"{os.getpid()}\n")  # this test's own process: the host's namespace
    with pytest.raises(IngressConfigError, match="host's network namespace"):
        netns_path(config)
    gone = subprocess.Popen(["true"])
    gone.wait()
    pid_file.write_text(f"{gone.pid}\n")
    with pytest.raises(IngressConfigError, match="the sandbox process is gone"):
        netns_path(config)
    pid_file.write_text("not a pid\n")
    with pytest.raises(IngressConfigError, match="no sandbox pid"):
        netns_path(config)
