"""A `tee: simulated` Security CVM release: its rendered proxy quotes with the simulator (the PKI
in its launch directory, RTMR3 replayed from the launch agent's event log), which a test
forwarder accepts and every production configuration refuses. No Docker here: the evidence is
built exactly as `umbra proxy serve --quote-source simulated` builds it in the container
(tests/images/test_compose_docker.py runs the container)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from umbra.attest.simpki import SimulatedPki
from umbra.attest.verify import Step
from umbra.components.launch_data import LaunchData
from umbra.images.definition import DefinitionError, parse_definition
from umbra.images.launch_agent import Agent, LogOnly
from umbra.images.measure import measure
from umbra.proxy.tunnel_quote import build_evidence
from umbra.sandbox.dev_definition import forwarder_config
from umbra.sandbox.forwarder_config import ForwarderConfig
from umbra.sandbox.forwarder_setup import build_verifier
from umbra.sandbox.models import SecurityCvmInputs
from umbra.sandbox.validate import ComposeError, validate_security_compose

from ..sandbox.fixtures import dev_definition, security_definition, security_definition_doc

SIMULATED: dict[str, Any] = {"simulated": {}, "console_ca": True}
TESTING: dict[str, Any] = {
    "allow_upstream": ["172.17.0.0/16"],
    "resolver": {"origin.test": ["172.17.0.1"]},
}


class _Given:
    def __init__(self, meta: dict[str, str]) -> None:
        self.meta = meta

    def fetch(self) -> dict[str, str]:
        return self.meta

    def instance_name(self) -> str:
        raise AssertionError("launch data without umbra-instance-name asks no name")


class _NoStart:
    def start(self, compose: Path) -> None:
        return None


def _command(text: str) -> list[str]:
    command: list[str] = yaml.safe_load(text)["services"]["proxy"]["command"]
    return command


def test_a_simulated_release_renders_simulated_quotes_and_its_test_options() -> None:
    m = measure(security_definition(**SIMULATED, test_options=TESTING))
    doc = yaml.safe_load(m.compose.text)
    proxy = doc["services"]["proxy"]
    command = proxy["command"]
    at = command.index("--quote-source")
    assert command[at : at + 6] == ["--quote-source", "simulated", "--simulated-pki",
                                    "/run/umbra/launch/simulated-pki", "--simulated-image",
                                    "umbra-security-cvm"]  # fmt: skip
    assert command[command.index("--console-ca") + 1] == "/run/umbra/launch/console-ca.pem"
    assert command[command.index("--test-allow-upstream") + 1] == "172.17.0.0/16"
    # No TD interface to mount: the simulator needs none.
    assert not any("tsm" in v for v in proxy["volumes"])
    assert json.loads(doc["configs"]["test_resolver"]["content"]) == {"origin.test": ["172.17.0.1"]}
    assert {"source": "test_resolver", "target": "/etc/umbra/test-resolver.json"} in proxy[
        "configs"
    ]
    # The production file is unchanged by the new inputs' defaults.
    assert _command(measure(security_definition()).compose.text).count("configfs") == 1


def test_test_options_and_simulated_quotes_never_reach_a_tdx_release() -> None:
    with pytest.raises(ValidationError, match="test_options need simulated quotes"):
        SecurityCvmInputs.model_validate(security_definition_doc(test_options=TESTING)["compose"])
    doc = security_definition_doc(**SIMULATED)
    doc |= {"tee": "tdx", "base": {k: ["00" * 48] for k in ("mrtd", "rtmr0", "rtmr1", "rtmr2")}}
    with pytest.raises(DefinitionError, match="must not let its proxy quote with the simulator"):
        parse_definition(doc)
    doc = security_definition_doc(simulated={"image": "umbra-other"})
    with pytest.raises(DefinitionError, match=r"compose\.simulated\.image must be"):
        parse_definition(doc)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        # A configfs (production) file carrying a test option or the simulator's PKI.
        (lambda c: [*c, "--test-allow-upstream", "0.0.0.0/0"], "--test-allow-upstream only in a"),
        (lambda c: [*c, "--simulated-pki", "/run/umbra/launch/p"], "--simulated-pki only in a"),
        (lambda c: [*c, "--policy-dir", "/etc/umbra"], "--policy-dir only in a simulated"),
        (lambda c: [x if x != "configfs" else "azure" for x in c], "quotes with --quote-source"),
    ],
)
def test_the_validator_keeps_test_options_out_of_a_configfs_release(
    change: Any, expected: str
) -> None:
    doc = yaml.safe_load(measure(security_definition()).compose.text)
    doc["services"]["proxy"]["command"] = change(doc["services"]["proxy"]["command"])
    with pytest.raises(ComposeError, match=expected):
        validate_security_compose(yaml.safe_dump(doc, sort_keys=False))


def test_the_validator_confines_a_simulated_release() -> None:
    text = measure(security_definition(**SIMULATED)).compose.text
    doc = yaml.safe_load(text)
    doc["services"]["proxy"]["volumes"].append(
        "/sys/kernel/config/tsm/report:/sys/kernel/config/tsm/report"
    )
    with pytest.raises(ComposeError, match="a simulated release does not mount"):
        validate_security_compose(yaml.safe_dump(doc, sort_keys=False))
    doc = yaml.safe_load(text)
    command = doc["services"]["proxy"]["command"]
    command[command.index("--simulated-pki") + 1] = "/etc/umbra/pki"
    with pytest.raises(ComposeError, match="--simulated-pki must be in the launch directory"):
        validate_security_compose(yaml.safe_dump(doc, sort_keys=False))


def test_simulated_evidence_passes_a_test_forwarder_and_production_refuses_its_root(
    tmp_path: Path,
) -> None:
    sec = security_definition(**SIMULATED)
    m = measure(sec)
    data = LaunchData(
        role="security-cvm",
        team="acme",
        cvm_id="cvm_0123456789abcdef",  # the Console's id form
        app_compose=m.app_compose.decode(),
        console_ca="-----BEGIN CERTIFICATE-----\nusc\n-----END CERTIFICATE-----\n",
        enrollment_token="usc-token-0123456789abcdef",
    )
    launch = tmp_path / "launch"
    Agent(_Given(data.as_metadata()), LogOnly(), _NoStart(), None, launch,
          lambda _line: None, etc_dir=tmp_path).run()  # fmt: skip
    own = launch / "security"
    # What the rendered proxy reads from its launch directory, written by the launch agent.
    assert (own / "identities.yaml").read_text() == "cvms: []\n"
    assert (own / "console-ca.pem").read_text() == data.console_ca
    assert (own / "security-cvm-id").read_text() == "cvm_0123456789abcdef\n"
    assert oct((own / "enrollment-token").stat().st_mode & 0o777) == "0o400"

    pki = SimulatedPki.generate()
    pki.save(own / "simulated-pki")  # not launch data: the simulated host provides it
    source, events = build_evidence(
        "simulated",
        event_log=own / "event-log.json",
        simulated_pki=own / "simulated-pki",
        simulated_image=sec.base.simulated_image or "",
    )
    report = os.urandom(64)
    quote = source.get_quote(report)
    assert events is not None
    log = list(events())
    collateral = tmp_path / "collateral.json"
    collateral.write_text(pki.collateral(int(time.time()) - 60).json_text)
    (tmp_path / "root.der").write_bytes(pki.root_der)

    def forwarder(allow_simulated: bool) -> ForwarderConfig:
        dev = dev_definition(
            security_cvm_release=m.release.model_dump(mode="json", exclude_none=True),
            allow_simulated=allow_simulated,
        )
        doc = forwarder_config(dev.host) | {"collateral": {"file": str(collateral)}}
        if allow_simulated:
            doc["simulated_root"] = str(tmp_path / "root.der")
        return ForwarderConfig.model_validate(doc)

    # The test forwarder (a simulated Dev release): the quote and the replayed RTMR3 match the
    # measured Security release, compose hash included.
    ok = build_verifier(forwarder(True)).verify(quote, event_log=log, expected_report_data=report)
    assert ok.ok and ok.simulated, ok.reasons
    # A production forwarder (no allow_simulated: what a tee: tdx Dev release must have) refuses
    # the same evidence: the simulator's root is never trusted.
    refused = build_verifier(forwarder(False)).verify(
        quote, event_log=log, expected_report_data=report
    )
    assert not refused.ok
    assert [f.step for f in refused.failures] == [Step.POLICY]
    assert "simulated quotes were not allowed" in " ".join(refused.reasons)


def test_the_simulated_command_parses_as_a_valid_proxy_config() -> None:
    """Every argument of the simulated release's command is a real `umbra proxy serve` option
    and together they are a valid configuration (the container would start, not exit 2)."""
    from typer.main import get_command

    from umbra.cli.proxy import _config_values
    from umbra.cli.proxy import app as proxy_app
    from umbra.proxy.config import ProxyConfig

    command = _command(measure(security_definition(**SIMULATED, test_options=TESTING)).compose.text)
    params = get_command(proxy_app).make_context("serve", command[3:]).params
    values = _config_values(params) | {"security_cvm_id": "cvm_0123456789abcdef", "workers": 1}
    config = ProxyConfig(**values)
    assert config.quote_source == "simulated"
    assert str(config.console_ca) == "/run/umbra/launch/console-ca.pem"
    assert config.test_allow_upstream == ["172.17.0.0/16"]
    assert str(config.test_resolver) == "/etc/umbra/test-resolver.json"
