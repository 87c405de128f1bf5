"""Rendering is deterministic and every rendered file passes, and is held to, the structural rules."""

from __future__ import annotations

import inspect
import json
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from umbra.cli.image import launch_agent_cmd
from umbra.components.ports import DEV_UPLINK_CIDR
from umbra.images.launch_agent import DATA_MOUNT, WORKSPACE
from umbra.sandbox.forwarder_config import ForwarderConfig
from umbra.sandbox.models import DevCvmInputs, check_image_ref
from umbra.sandbox.render import render_dev_cvm, render_security_cvm
from umbra.sandbox.validate import (
    WORKSPACE_DIR,
    ComposeError,
    service_networks,
    validate_dev_compose,
    validate_security_compose,
)

from .fixtures import dev_definition, dev_definition_doc, digest_ref, security_definition


def _dev_text() -> str:
    return render_dev_cvm(dev_definition().compose).text


def test_same_inputs_same_bytes() -> None:
    a = render_dev_cvm(dev_definition().compose)
    b = render_dev_cvm(dev_definition().compose)
    assert a.data == b.data and a.sha256 == b.sha256
    s1 = render_security_cvm(security_definition().compose)
    s2 = render_security_cvm(security_definition().compose)
    assert s1.data == s2.data


def test_an_input_change_changes_the_bytes() -> None:
    base = render_dev_cvm(dev_definition().compose).data
    other = render_dev_cvm(dev_definition(proxy_port=3129).compose).data
    assert base != other


def test_dev_topology_as_rendered() -> None:
    doc = yaml.safe_load(_dev_text())
    services, networks = doc["services"], doc["networks"]
    # No sshd and no published port: SSH is the attested ingress's, a host process.
    assert set(services) == {"sandbox", "forwarder"}
    assert not any("ports" in s for s in services.values())
    sandbox = services["sandbox"]
    assert sandbox["runtime"] == "sysbox-runc"
    assert set(service_networks(sandbox)) == {"sandbox"}
    assert networks["sandbox"]["internal"] is True
    assert set(networks) == {"sandbox", "uplink"}  # no `sessions` leftover
    assert "internal" not in networks["uplink"]
    on_uplink = [n for n, s in services.items() if "uplink" in service_networks(s)]
    assert on_uplink == ["forwarder"]
    assert not any("privileged" in s or "network_mode" in s for s in services.values())
    for svc in services.values():
        check_image_ref(svc["image"])
    # The forwarder's config is embedded (so measured) and binds to its sandbox address only.
    cfg = ForwarderConfig.model_validate(json.loads(doc["configs"]["forwarder"]["content"]))
    assert cfg.listen.host == services["forwarder"]["networks"]["sandbox"]["ipv4_address"]
    assert set(services["forwarder"]["networks"]) == {"sandbox", "uplink"}
    # The attested CA: the forwarder writes it into `sandbox-ca`, the sandbox mounts it read-only
    # and its init installs the file named on its command line.
    assert cfg.sandbox_ca is not None
    assert "sandbox-ca:/var/lib/umbra/sandbox-ca" in services["forwarder"]["volumes"]
    assert "sandbox-ca:/run/umbra/security-ca:ro" in sandbox["volumes"]
    command = sandbox["command"]
    assert (
        command[command.index("--ca") + 1] == "/run/umbra/security-ca/" + cfg.sandbox_ca.file.name
    )
    env = sandbox["environment"]
    assert env["HTTPS_PROXY"] == f"http://{cfg.listen.host}:3128"
    assert set(doc["configs"]) == {"forwarder"}


def test_security_topology_as_rendered() -> None:
    doc = yaml.safe_load(render_security_cvm(security_definition().compose).text)
    services = doc["services"]
    assert set(services) == {"proxy"}
    assert services["proxy"]["ports"] == ["8443:8443/tcp"]
    command = services["proxy"]["command"]
    assert command[command.index("--listen") + 1] == "127.0.0.1:8080"
    assert command[command.index("--tunnel-listen") + 1] == "0.0.0.0:8443"
    assert "BEGIN PUBLIC KEY" in doc["configs"]["bundle_keys"]["content"]


def test_security_services_run_commands_that_exist() -> None:
    """Every argument of the rendered command parses with the real `umbra proxy serve`."""
    from typer.main import get_command
    from typer.testing import CliRunner

    from umbra.cli.app import app
    from umbra.cli.proxy import app as proxy_app

    doc = yaml.safe_load(render_security_cvm(security_definition().compose).text)
    group = get_command(proxy_app)
    for svc in doc["services"].values():
        command = svc["command"]
        assert command[:3] == ["umbra", "proxy", "serve"]
        listing = CliRunner().invoke(app, ["proxy", "--help"])
        assert listing.exit_code == 0 and " serve " in listing.output
        # `umbra proxy` has one command, so typer makes the app that command itself.
        params = group.make_context("serve", list(command[3:])).params
        assert params["tunnel_listen"] == "0.0.0.0:8443"
        assert params["console"] == "https://console.example"
        assert params["quote_source"] == "configfs"
        assert params["listen"] == "127.0.0.1:8080"


def _mutate(text: str, change: Any) -> str:
    doc = yaml.safe_load(text)
    change(doc)
    return yaml.safe_dump(doc, sort_keys=False)


def _bind(device: str) -> dict[str, str]:
    return {"type": "none", "o": "bind", "device": device}


def _set(path: list[str], value: Any) -> Any:
    def go(doc: Any) -> None:
        for key in path[:-1]:
            doc = doc[key]
        doc[path[-1]] = value

    return go


def _forwarder_doc(change: Any) -> Any:
    def go(doc: Any) -> None:
        cfg = json.loads(doc["configs"]["forwarder"]["content"])
        change(cfg)
        doc["configs"]["forwarder"]["content"] = json.dumps(cfg)

    return go


# The forwarder relaying SSH to a plain sshd: what the Dev compose no longer has.
PLAIN_RELAY = {
    "listen_host": "10.9.9.9",
    "listen_port": 2222,
    "to": {"host": "172.30.1.3", "port": 22},
    "refuse_sources": ["172.30.0.0/24"],
}


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (_set(["networks", "sandbox", "internal"], False), "network sandbox must be internal"),
        (_set(["services", "sandbox", "privileged"], True), "privileged containers are never"),
        (_set(["services", "forwarder", "network_mode"], "host"), "network_mode"),
        (_set(["services", "sandbox", "image"], "ubuntu:24.04"), "not pinned by digest"),
        (_set(["services", "sandbox", "runtime"], "runc"), "runtime must be sysbox-runc"),
        (
            _set(["services", "sandbox", "networks"], {"sandbox": {}, "uplink": {}}),
            "only the forwarder may have an uplink",
        ),
        (_set(["services", "sandbox", "ports"], ["8080:8080/tcp"]), "publishes ports"),
        (_set(["services", "forwarder", "ports"], ["8022:2222/tcp"]), "publishes ports"),
        (_set(["services", "forwarder", "ports"], ["53:53/udp"]), "must be TCP"),
        (
            _set(["services", "sshd"], {"image": digest_ref("sshd"), "networks": ["sessions"]}),
            "services must be exactly",
        ),
        (
            _set(["services", "sandbox", "volumes"], ["/var/run/docker.sock:/var/run/docker.sock"]),
            "Docker socket",
        ),
        (_set(["services", "sandbox", "volumes"], ["/:/host"]), "not under /run/umbra/launch/"),
        (
            _set(["services", "forwarder", "volumes"], ["/run/umbra/launch/ssh:/etc/umbra/ssh"]),
            "read-only",
        ),
        (_set(["services", "forwarder", "cap_add"], ["NET_ADMIN"]), "cap_add NET_ADMIN"),
        (_set(["services", "sandbox", "security_opt"], ["seccomp=unconfined"]), "disables"),
        (_set(["networks", "uplink", "enable_ipv6"], True), "enable_ipv6 must be false"),
        (_set(["networks", "extra"], {"driver": "bridge", "enable_ipv6": False}), "networks must"),
        (_set(["services", "sandbox", "dns"], ["8.8.8.8"]), "custom DNS"),
        (_set(["networks", "sandbox", "external"], True), "external"),
        (
            _set(["networks", "sandbox", "driver_opts"], {"com.docker.network.bridge.name": "x"}),
            "must be umbra-sbx0",
        ),
        (
            _set(["networks", "uplink", "driver_opts"], {"com.docker.network.driver.mtu": "9000"}),
            "driver_opts 'com.docker.network.driver.mtu' is not allowed",
        ),
        # A plain relay to SSH would bypass the attested ingress: the forwarder has none.
        (
            _forwarder_doc(lambda c: c.update(ingress=PLAIN_RELAY)),
            "Extra inputs are not permitted",
        ),
        # The sandbox trusts only the CA the forwarder attested, and cannot write it.
        (_forwarder_doc(lambda c: c.pop("sandbox_ca")), "needs `sandbox_ca`"),
        (
            _forwarder_doc(lambda c: c.update(sandbox_ca={"file": "/tmp/ca.pem"})),
            "sandbox_ca.file must be in a named volume",
        ),
        (
            _set(
                ["services", "sandbox", "volumes"],
                ["sandbox-ca:/run/umbra/security-ca"],
            ),
            "volume sandbox-ca must be mounted read-only",
        ),
        (
            lambda d: d["configs"]["forwarder"].update(
                content=d["configs"]["forwarder"]["content"].replace(
                    '"host":"172.30.0.2"', '"host":"0.0.0.0"'
                )
            ),
            "not a wildcard",
        ),
        # Enrollment: the tunnel credential only from an attested enrollment, kept in a volume.
        (_forwarder_doc(lambda c: c.pop("enrollment")), "needs `enrollment`"),
        (
            _forwarder_doc(lambda c: c.update(credential_file="/run/umbra/launch/tunnel-cred")),
            "credential_file must be in a state volume",
        ),
        (
            lambda d: d["services"]["sandbox"]["volumes"].append(
                "/sys/kernel/config/tsm/report:/sys/kernel/config/tsm/report"
            ),
            "only the forwarder may mount /sys/kernel/config/tsm/report",
        ),
        (lambda d: d["networks"]["uplink"].pop("ipam"), "network uplink: ipam.config must pin"),
        # A volume definition could bind any host path around the host-path rule: only plain
        # volumes, and the workspace's one bind onto the data disk.
        (
            _set(["volumes", "sessions"], {"driver": "local", "driver_opts": _bind("/etc")}),
            "volume sessions: only a plain volume",
        ),
        (
            _set(["volumes", "workspace"], {"driver": "local", "driver_opts": _bind("/")}),
            "the workspace may bind exactly /var/lib/umbra/data/workspace",
        ),
    ],
)
def test_validator_refuses_each_break(change: Any, expected: str | None) -> None:
    text = _mutate(_dev_text(), change)
    if expected is None:
        validate_dev_compose(text)
        return
    with pytest.raises(ComposeError) as info:
        validate_dev_compose(text)
    assert any(expected in p for p in info.value.problems), info.value.problems


def test_the_forwarder_enrolls_at_first_start_and_keeps_its_credential_in_a_volume() -> None:
    doc = yaml.safe_load(_dev_text())
    cfg = ForwarderConfig.model_validate(json.loads(doc["configs"]["forwarder"]["content"]))
    assert cfg.enrollment is not None and cfg.credential_file is not None
    assert cfg.enrollment.console_url == "https://console.example"
    assert cfg.enrollment.quote_source == "configfs"
    assert str(cfg.enrollment.token_file) == "/run/umbra/launch/enrollment-token"
    assert str(cfg.enrollment.event_log) == "/run/umbra/launch/event-log.json"
    assert str(cfg.enrollment.console_ips_file) == "/run/umbra/launch/console-ips"
    assert cfg.enrollment.console_ca is None
    # The state volume (spent-token hash beside it): a restart or reboot never re-enrolls.
    assert str(cfg.credential_file) == "/var/lib/umbra/forwarder/tunnel-credential"
    volumes = doc["services"]["forwarder"]["volumes"]
    assert "forwarder-state:/var/lib/umbra/forwarder" in volumes
    assert "/sys/kernel/config/tsm/report:/sys/kernel/config/tsm/report" in volumes
    assert "forwarder-state" in doc["volumes"]
    assert not any("tsm" in v for v in doc["services"]["sandbox"]["volumes"])
    # The uplink's subnet is the one the host firewall admits.
    assert doc["networks"]["uplink"]["ipam"]["config"] == [{"subnet": DEV_UPLINK_CIDR}]
    with_ca = render_dev_cvm(dev_definition(console_ca=True).compose).text
    cfg = ForwarderConfig.model_validate(
        json.loads(yaml.safe_load(with_ca)["configs"]["forwarder"]["content"])
    )
    assert cfg.enrollment is not None
    assert str(cfg.enrollment.console_ca) == "/run/umbra/launch/console-ca.pem"


def test_the_workspace_is_bound_to_the_data_disk() -> None:
    """The developer's work is on the persistent data disk the launch agent mounts, not in
    docker's data-root (a tmpfs on the verity-rooted OS image): it survives a stop."""
    doc = yaml.safe_load(_dev_text())
    assert doc["volumes"]["workspace"] == {"driver": "local", "driver_opts": _bind(WORKSPACE_DIR)}
    assert "workspace:/home/dev/work" in doc["services"]["sandbox"]["volumes"]
    assert WORKSPACE.parent == DATA_MOUNT
    # The launch agent's CLI creates the same directory by default.
    default = inspect.signature(launch_agent_cmd).parameters["workspace_dir"].default
    assert default == WORKSPACE


def test_duplicate_keys_are_refused() -> None:
    text = _dev_text().replace(
        "    internal: true\n", "    internal: true\n    internal: false\n", 1
    )
    with pytest.raises(ComposeError, match="duplicate key 'internal'"):
        validate_dev_compose(text)


def test_security_validator_refuses_publishing_proxy() -> None:
    text = render_security_cvm(security_definition().compose).text
    bad = _mutate(text, _set(["services", "proxy", "ports"], ["8443:8443/tcp", "8080:8080/tcp"]))
    with pytest.raises(ComposeError, match="publishes only the tunnel endpoint"):
        validate_security_compose(bad)


def test_security_validator_refuses_a_reachable_proxy_listener() -> None:
    text = render_security_cvm(security_definition().compose).text

    def widen(doc: Any) -> None:
        command = doc["services"]["proxy"]["command"]
        command[command.index("--listen") + 1] = "0.0.0.0:8080"

    with pytest.raises(ComposeError, match="--listen must be a loopback address"):
        validate_security_compose(_mutate(text, widen))


def test_security_validator_confines_the_tsm_mount() -> None:
    text = render_security_cvm(security_definition().compose).text

    def remount(doc: Any) -> None:
        doc["services"]["proxy"]["volumes"].append("/sys/kernel/config:/sys/kernel/config")

    with pytest.raises(ComposeError, match="host path /sys/kernel/config is not under"):
        validate_security_compose(_mutate(text, remount))


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("images", {"sandbox": "ubuntu:latest", "forwarder": digest_ref("f")}, "not pinned"),
        ("unknown_field", 1, "Extra inputs are not permitted"),
        ("tunnels", [{"name": "x", "listen_port": 3128, "host": "github.com", "port": 22}], "distinct"),
        ("security_cvm", {"host": "evil\nhost: x", "port": 1}, "not a lowercase DNS name"),
        ("sessions_subnet", "172.30.1.0/24", "Extra inputs are not permitted"),
        ("uplink_subnet", "172.30.0.0/29", "overlap"),
        ("console_url", "http://console.example", "String should match pattern"),
    ],
)  # fmt: skip
def test_inputs_are_typed_and_strict(field: str, value: Any, expected: str) -> None:
    doc = dev_definition_doc()["compose"]
    doc[field] = value
    with pytest.raises(ValidationError, match=expected):
        DevCvmInputs.model_validate(doc)


_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=12))
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    path=st.lists(st.sampled_from(["services", "sandbox", "forwarder", "sshd", "networks", "uplink", "configs", "content", "volumes", "ports", "cap_add", "ipam", "config", "subnet"]), min_size=1, max_size=4),
    value=_values,
)  # fmt: skip
def test_any_mangled_compose_is_refused_or_valid_never_a_crash(path: list[str], value: Any) -> None:
    doc: Any = yaml.safe_load(_DEV_TEXT)
    node = doc
    for key in path[:-1]:
        if not isinstance(node, dict):
            break
        node = node.setdefault(key, {})
    if isinstance(node, dict):
        node[path[-1]] = value
    problems: list[str] = []
    try:
        validate_dev_compose(yaml.safe_dump(doc))
    except ComposeError as exc:  # the only failure allowed, and it must say what is wrong
        problems = exc.problems or [""]
    assert all(isinstance(p, str) and p for p in problems)


_DEV_TEXT = render_dev_cvm(dev_definition().compose).text


def test_the_security_spool_binds_the_data_disk_and_nothing_else() -> None:
    """Fails before the fix: the spool was a plain Docker volume on tmpfs, lost by every reboot."""
    from umbra.sandbox.validate import SPOOL_DIR, SPOOL_VOLUME

    text = render_security_cvm(security_definition().compose).text
    assert yaml.safe_load(text)["volumes"]["spool"] == SPOOL_VOLUME
    assert SPOOL_DIR == "/var/lib/umbra/data/spool"

    def tmpfs(doc: Any) -> None:
        doc["volumes"]["spool"] = {}

    with pytest.raises(ComposeError, match="volume spool must bind the data disk"):
        validate_security_compose(_mutate(text, tmpfs))

    def elsewhere(doc: Any) -> None:
        doc["volumes"]["spool"]["driver_opts"]["device"] = "/etc"

    with pytest.raises(ComposeError, match="the spool may bind exactly /var/lib/umbra/data/spool"):
        validate_security_compose(_mutate(text, elsewhere))

    def policy_bind(doc: Any) -> None:
        doc["volumes"]["policy"] = SPOOL_VOLUME

    with pytest.raises(ComposeError, match="volume policy: only a plain volume"):
        validate_security_compose(_mutate(text, policy_bind))
