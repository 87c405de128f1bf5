"""Render the Dev CVM and Security CVM compose files from typed inputs, then validate them.

Deterministic: templates are package data, every value comes from the pydantic inputs, mappings
are emitted in template order and embedded JSON with sorted keys, so the same inputs give the
same bytes (and the same compose hash). Nothing is returned that did not pass validation.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

import jinja2

from umbra.contracts.canonical import canonical_json as _canonical
from umbra.sandbox.models import DevCvmInputs, SecurityCvmInputs
from umbra.sandbox.validate import WORKSPACE_DIR, validate_dev_compose, validate_security_compose

FORWARDER_CONFIG_PATH = "/etc/umbra/forwarder.json"
LAUNCH_DIR = "/run/umbra/launch"
# The forwarder's state volume: the tunnel credential and the spent token's hash live here, so a
# restart or a reboot (the launch agent writes the same token again) never re-enrolls.
FORWARDER_STATE_DIR = "/var/lib/umbra/forwarder"
# The attested interception CA bundle: written by the forwarder into the `sandbox-ca` volume,
# read by the sandbox's init through a read-only mount of the same volume.
FORWARDER_CA_DIR = "/var/lib/umbra/sandbox-ca"
SANDBOX_CA_DIR = "/run/umbra/security-ca"
CA_NAME = "security-cvm-ca.pem"
# The uid the rendered forwarder and proxy services run as (the templates' `user: "65534:65534"`).
SERVICE_UID = 65534


@dataclass(frozen=True)
class Rendered:
    name: str  # file name, e.g. "docker-compose.yaml"
    text: str

    @property
    def data(self) -> bytes:
        return self.text.encode()

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


def canonical_json(doc: Any) -> str:
    """The shared canonical JSON (`umbra.contracts.canonical`), ASCII-only, as text."""
    return _canonical(doc, ascii_only=True).decode("ascii")


def _yaml_string(value: str) -> str:
    # A JSON string is a valid YAML double-quoted scalar; ASCII-only so no byte depends on locale.
    return json.dumps(value, ensure_ascii=True)


def _env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FunctionLoader(_load_template),
        undefined=jinja2.StrictUndefined,
        autoescape=False,  # noqa: S701 -- YAML, not HTML; every value is pattern-checked
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["yaml_string"] = _yaml_string
    return env


def _load_template(name: str) -> str:
    return resources.files("umbra.sandbox").joinpath("templates", name).read_text()


def _host(net: ipaddress.IPv4Network, n: int) -> str:
    return str(net.network_address + n)  # .1 is the bridge gateway Docker takes


def dev_addresses(inputs: DevCvmInputs) -> dict[str, str]:
    return {
        "forwarder_sandbox": _host(inputs.sandbox_subnet, 2),
        "sandbox": _host(inputs.sandbox_subnet, 3),
    }


def forwarder_config(inputs: DevCvmInputs) -> dict[str, Any]:
    addr = dev_addresses(inputs)
    doc: dict[str, Any] = {
        "apiVersion": "umbra/v1",
        "kind": "ForwarderConfig",
        "listen": {
            "host": addr["forwarder_sandbox"],
            "proxy_port": inputs.proxy_port,
            "tunnels": [t.model_dump(mode="json") for t in inputs.tunnels],
        },
        "security_cvm": inputs.security_cvm.model_dump(mode="json"),
        "security_cvm_release": inputs.security_cvm_release.model_dump(
            mode="json", exclude_none=True
        ),
        "collateral": {"pccs_urls": list(inputs.pccs_urls)},
        "cvm_id_file": f"{LAUNCH_DIR}/cvm-id",
        "credential_file": f"{FORWARDER_STATE_DIR}/tunnel-credential",
        "sandbox_ca": {"file": f"{FORWARDER_CA_DIR}/{CA_NAME}"},
        # The Dev CVM resolves nothing: the launch agent's Security CVM address(es), by file.
        "security_cvm_ips_file": f"{LAUNCH_DIR}/security-cvm-ips",
        # Launch-bound files the launch agent writes into the forwarder's launch directory.
        "enrollment": {
            "console_url": inputs.console_url,
            "token_file": f"{LAUNCH_DIR}/enrollment-token",
            "quote_source": "configfs",
            "event_log": f"{LAUNCH_DIR}/event-log.json",
            "console_ips_file": f"{LAUNCH_DIR}/console-ips",
        },
    }
    if inputs.console_ca:
        doc["enrollment"]["console_ca"] = f"{LAUNCH_DIR}/console-ca.pem"
    if inputs.allow_simulated:
        doc["allow_simulated"] = True
        doc["simulated_root"] = f"{LAUNCH_DIR}/simulated-root.der"
    return doc


def render_dev_cvm(inputs: DevCvmInputs) -> Rendered:
    env = _env()
    text = env.get_template("dev-cvm.compose.yaml.j2").render(
        release=inputs.release,
        images=inputs.images,
        addr=dev_addresses(inputs),
        sandbox_user=inputs.sandbox_user,
        proxy_port=inputs.proxy_port,
        sandbox_subnet=str(inputs.sandbox_subnet),
        uplink_subnet=str(inputs.uplink_subnet),
        forwarder_state_dir=FORWARDER_STATE_DIR,
        forwarder_ca_dir=FORWARDER_CA_DIR,
        sandbox_ca_dir=SANDBOX_CA_DIR,
        ca_name=CA_NAME,
        workspace_dir=WORKSPACE_DIR,
        forwarder_config=canonical_json(forwarder_config(inputs)),
    )
    validate_dev_compose(text)
    return Rendered("docker-compose.yaml", text)


def security_options(
    inputs: SecurityCvmInputs,
) -> tuple[list[str], dict[str, tuple[str, str]]]:
    """The release-dependent part of the proxy's command line, and the extra configs it reads
    (name -> (target path, content))."""
    args: list[str] = []
    configs: dict[str, tuple[str, str]] = {}
    if inputs.simulated is None:
        args += ["--quote-source", "configfs"]
    else:
        args += ["--quote-source", "simulated", "--simulated-pki", f"{LAUNCH_DIR}/simulated-pki",
                 "--simulated-image", inputs.simulated.image]  # fmt: skip
    if inputs.console_ca:
        args += ["--console-ca", f"{LAUNCH_DIR}/console-ca.pem"]
    test = inputs.test_options
    if test is not None:
        for net in test.allow_upstream:
            args += ["--test-allow-upstream", str(net)]
        if test.resolver:
            resolver = {name: [str(ip) for ip in ips] for name, ips in test.resolver.items()}
            configs["test_resolver"] = ("/etc/umbra/test-resolver.json", canonical_json(resolver))
            args += ["--test-resolver", "/etc/umbra/test-resolver.json"]
        if test.upstream_ca is not None:
            configs["upstream_ca"] = ("/etc/umbra/upstream-ca.pem", test.upstream_ca)
            args += ["--upstream-ca", "/etc/umbra/upstream-ca.pem"]
    return args, configs


def render_security_cvm(inputs: SecurityCvmInputs) -> Rendered:
    options, configs = security_options(inputs)
    text = (
        _env()
        .get_template("security-cvm.compose.yaml.j2")
        .render(
            release=inputs.release,
            images=inputs.images,
            tunnel_port=inputs.tunnel_port,
            proxy_port=inputs.proxy_port,
            console_url=inputs.console_url,
            bundle_keys="".join(k if k.endswith("\n") else k + "\n" for k in inputs.bundle_keys),
            options=", ".join(json.dumps(a, ensure_ascii=True) for a in options),
            quotes_configfs=inputs.simulated is None,
            configs=configs,
        )
    )
    validate_security_compose(text)
    return Rendered("docker-compose.yaml", text)
