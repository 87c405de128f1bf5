"""Render the Security CVM compose file from typed inputs, then validate it (the Dev CVM's measured
document is its host definition, sandbox/dev_definition.py).

Deterministic: templates are package data, every value comes from the pydantic inputs, mappings
are emitted in template order and embedded JSON with sorted keys, so the same inputs give the
same bytes (and the same compose hash). Nothing is returned that did not pass validation.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib import resources

import jinja2

from umbra.attest.tdx_port import QUOTE_SOCKET_NAME
from umbra.contracts.canonical import canonical_text
from umbra.sandbox.models import SecurityCvmInputs, SimulatedQuoteSource
from umbra.sandbox.validate import validate_security_compose

LAUNCH_DIR = "/run/umbra/launch"
# The attested interception CA bundle's file name (the forwarder writes it, the sandbox's init
# installs it).
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


canonical_json = canonical_text  # the shared canonical JSON (`umbra.contracts.canonical`), as text


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


def security_options(
    inputs: SecurityCvmInputs,
) -> tuple[list[str], dict[str, tuple[str, str]]]:
    """The release-dependent part of the proxy's command line, and the extra configs it reads
    (name -> (target path, content))."""
    args: list[str] = []
    configs: dict[str, tuple[str, str]] = {}
    if inputs.simulated is None:
        args += ["--quote-source", "configfs"]
    elif inputs.simulated.source is SimulatedQuoteSource.emulated:
        args += ["--quote-source", "emulated",
                 "--tdx-quote-socket", f"{LAUNCH_DIR}/{QUOTE_SOCKET_NAME}"]  # fmt: skip
    else:
        args += ["--quote-source", "simulated", "--simulated-pki", f"{LAUNCH_DIR}/simulated-pki",
                 "--simulated-image", inputs.simulated.image]  # fmt: skip
    if inputs.console_ca:
        args += ["--console-ca", f"{LAUNCH_DIR}/console-ca.pem"]
    for url in inputs.pccs_urls:
        args += ["--tunnel-collateral-pccs", url]
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
