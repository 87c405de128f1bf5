"""The measured Dev CVM host definition (`dev-cvm.json`): rendered deterministically from its
inputs, wrapped by app-compose.json, and every loosening refused with the field and the reason."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from umbra.attest.simpki import SimulatedPki
from umbra.cli.app import app
from umbra.components import ports
from umbra.contracts.sandbox_env import RESERVED_ENV
from umbra.images.definition import DefinitionError, load_definition, parse_definition
from umbra.images.measure import measure
from umbra.sandbox import image, local_cvm
from umbra.sandbox.dev_definition import (
    RUNNER,
    SANDBOX_CA_FILE,
    SANDBOX_ENV_FILE,
    DevHostError,
    load_dev_host,
    network,
    render_dev_host,
)
from umbra.sandbox.dev_host import DevHost, _write_simulated_root
from umbra.sandbox.render import canonical_json

from .fixtures import dev_definition, dev_definition_doc

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "images/definitions/dev-cvm.example.yaml"


def _doc() -> dict[str, Any]:
    return dict(json.loads(render_dev_host(dev_definition().host).text))


def _refused(doc: dict[str, Any]) -> str:
    with pytest.raises(DevHostError) as info:
        load_dev_host(canonical_json(doc), "dev-cvm.json")
    return str(info.value)


def test_rendering_is_deterministic_canonical_and_the_runc_topology() -> None:
    a = render_dev_host(dev_definition().host)
    b = render_dev_host(dev_definition().host)
    assert a.text == b.text and a.name == "dev-cvm.json"
    doc = json.loads(a.text)
    assert canonical_json(doc) == a.text
    # Index 1 of local_cvm's scheme: the same addresses `umbra up` gives its first CVM.
    plan = local_cvm.LocalCvmPlan("cvm_x", 1, "umbra", "/x", 0)
    assert doc["network"] == {
        "index": 1,
        "sandbox": plan.sandbox_addr,
        "forwarder": plan.forwarder_addr,
        "uplink": plan.uplink_addr,
        "host": plan.host_addr,
    }
    # The host firewall's uplink is exactly the measured one.
    assert f"{doc['network']['host'][:-1]}0/30" == ports.DEV_UPLINK_CIDR
    listen = doc["forwarder"]["listen"]
    assert listen["host"] == plan.forwarder_addr
    assert (listen["proxy_port"], listen["dns_port"]) == (3128, 53)
    assert listen["transparent"] == {"https_port": 443, "http_port": 80}
    assert doc["forwarder"]["sandbox_ca"]["file"] == SANDBOX_CA_FILE
    # The sandbox environment: the file and base `umbra up`'s forwarder gets (one code path).
    assert doc["forwarder"]["sandbox_env"] == {
        "file": SANDBOX_ENV_FILE,
        "base": local_cvm.sandbox_env_base(local_cvm.LocalCvmPlan("cvm_x", 1, "umbra", "/x", 0)),
    }
    assert doc["forwarder"]["sandbox_env"]["base"]["HTTPS_PROXY"] == plan.proxy_url
    # Every one of the CVM's own names is one a profile may not set (the linter and the
    # forwarder refuse it), so a profile can never shadow or be silently shadowed by them.
    assert set(doc["forwarder"]["sandbox_env"]["base"]) <= RESERVED_ENV
    assert doc["sandbox_image"] == {
        "recipe_key": image.recipe_key(),
        "files_key": image.files_key(),
    }
    assert doc["ssh_ingress"]["sessions_dir"] == local_cvm.SANDBOX_SESSIONS


def test_app_compose_wraps_the_host_definition_and_its_hash_covers_every_byte() -> None:
    m = measure(dev_definition())
    app_doc = json.loads(m.app_compose)
    assert set(app_doc) == {"dev_cvm_host", "manifest_version", "name", "runner"}
    assert app_doc["runner"] == RUNNER == "umbra-dev-host"
    assert app_doc["dev_cvm_host"] == m.compose.text
    other = measure(dev_definition(tunnels=[]))
    assert other.compose_hash != m.compose_hash
    keys = {"recipe_key": "0" * 16, "files_key": image.files_key()}
    assert measure(dev_definition(sandbox_image=keys)).compose_hash != m.compose_hash


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["network"].update(sandbox="10.231.1.9"),
         "network.sandbox: 10.231.1.9 is not the runc topology's 10.231.1.2 for index 1"),
        (lambda d: d["network"].update(host="10.232.7.1"),
         "network.host: 10.232.7.1 is not the runc topology's 10.232.1.1"),
        (lambda d: d["forwarder"]["listen"].update(host="10.232.1.2"),
         "forwarder.listen.host must be network.forwarder"),
        (lambda d: d["forwarder"]["listen"].pop("dns_port"),
         "forwarder.listen needs transparent and dns_port"),
        (lambda d: d["forwarder"].pop("enrollment"),
         "forwarder.enrollment is required"),
        (lambda d: d["forwarder"].update(credential_file="/run/umbra/launch/forwarder/cred"),
         "credential_file must not be under /run/umbra/launch"),
        (lambda d: d["forwarder"]["sandbox_ca"].update(file="/tmp/ca.pem"),
         f"forwarder.sandbox_ca.file must be <root>/sandbox-ca/security-cvm-ca.pem (the "
         f"directory bound read-only into the sandbox; {SANDBOX_CA_FILE} on a CVM)"),
        (lambda d: d["forwarder"].pop("sandbox_env"),
         "forwarder.sandbox_env.file must be <root>/sandbox-etc/sandbox.env"),
        (lambda d: d["forwarder"]["sandbox_env"].update(file="/tmp/etc/sandbox.env"),
         f"(the directory bound read-only into the sandbox; {SANDBOX_ENV_FILE} on a CVM)"),
        (lambda d: d["forwarder"]["sandbox_env"]["base"].update(HTTPS_PROXY="http://x:1"),
         "forwarder.sandbox_env.base must be the runc topology's own values"),
        (lambda d: d["forwarder"]["sandbox_env"].update(refresh=0),
         "forwarder.sandbox_env.refresh: Input should be greater than or equal to 1"),
        (lambda d: d["sandbox_image"].update(recipe_key="latest"),
         "sandbox_image.recipe_key: String should match pattern"),
        (lambda d: d["ssh_ingress"].update(user="root"),
         "ssh_ingress.user: Input should be 'dev'"),
        (lambda d: d.update(runtime="sysbox-runc"),
         "runtime: Extra inputs are not permitted"),
        (lambda d: d["forwarder"].update(allow_simulated=True),
         "allow_simulated and simulated_root go together"),
        (lambda d: d.update(simulated_root=SimulatedPki.generate().root_pem()),
         "simulated_root needs forwarder.allow_simulated"),
        (lambda d: d.update(simulated_root="-----BEGIN CERTIFICATE-----\nAAAA\n"),
         "simulated_root: Value error, not a PEM certificate"),
    ],
)  # fmt: skip
def test_each_loosening_is_refused_with_its_field(mutate: Any, message: str) -> None:
    doc = _doc()
    mutate(doc)
    error = _refused(doc)
    assert error.startswith("dev-cvm.json: ")
    assert message in error


def test_non_canonical_duplicate_or_non_json_bytes_are_refused() -> None:
    text = render_dev_host(dev_definition().host).text
    with pytest.raises(DevHostError, match="not canonical JSON"):
        load_dev_host(json.dumps(json.loads(text), indent=1), "f")
    with pytest.raises(DevHostError, match="duplicate key 'release'"):
        load_dev_host('{"release":"a","release":"b"}', "f")
    with pytest.raises(DevHostError, match="f: not JSON"):
        load_dev_host("release: a", "f")
    with pytest.raises(DevHostError, match="top level must be an object"):
        load_dev_host("[]", "f")


def test_definition_inputs_are_strict() -> None:
    for field, value, message in [
        ("images", {"sandbox": "x"}, "host.images: Extra inputs are not permitted"),
        ("sandbox_subnet", "172.30.0.0/24", "host.sandbox_subnet: Extra inputs"),
        ("sandbox_image", {"recipe_key": "A" * 16, "files_key": "0" * 16},
         "host.sandbox_image.recipe_key"),
    ]:  # fmt: skip
        with pytest.raises(DefinitionError, match=message):
            parse_definition(dev_definition_doc(**{field: value}), "dev.yaml")
    doc = dev_definition_doc()
    doc["compose"] = doc.pop("host")  # the old layout's key
    with pytest.raises(DefinitionError, match=r"dev\.yaml: compose: Extra inputs"):
        parse_definition(doc, "dev.yaml")


def test_the_example_pins_the_image_keys_of_this_code() -> None:
    d = load_definition(EXAMPLE)
    assert d.role == "dev-cvm"
    keys = d.host.sandbox_image  # type: ignore[union-attr]
    assert (keys.recipe_key, keys.files_key) == (image.recipe_key(), image.files_key()), (
        "images/definitions/dev-cvm.example.yaml: update sandbox_image to this code's keys"
    )
    assert network(1).forwarder == "10.231.1.1"


def test_cli_render_and_check(tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "dev-cvm.json"
    done = runner.invoke(app, ["sandbox", "render", str(EXAMPLE), "--out", str(out)])
    assert done.exit_code == 0, done.output
    ok = runner.invoke(app, ["sandbox", "check", str(out)])
    assert ok.exit_code == 0, ok.output
    doc = json.loads(out.read_text())
    doc["network"]["uplink"] = "10.232.1.6"
    out.write_text(canonical_json(doc))
    bad = runner.invoke(app, ["sandbox", "check", str(out)])
    assert bad.exit_code == 1
    assert "network.uplink: 10.232.1.6 is not the runc topology's 10.232.1.2" in bad.output
    assert "Traceback" not in bad.output
    yaml_def = tmp_path / "d.yaml"
    yaml_def.write_text(yaml.safe_dump(dev_definition_doc(release="Bad_Name")))
    refused = runner.invoke(app, ["sandbox", "render", str(yaml_def)])
    assert refused.exit_code != 0 and "host.release" in refused.output


def test_a_simulated_root_is_measured_and_written_where_the_forwarder_reads_it(
    tmp_path: Path,
) -> None:
    """A `tee: simulated` Security release's root, named by the Dev release (CI, the emulated
    clouds): in the measured document (another root, another compose hash), and written by the
    dev host, as DER, at the forwarder's `simulated_root` before it starts."""
    pki, other = SimulatedPki.generate(), SimulatedPki.generate()
    with_root = dev_definition(allow_simulated=True, simulated_root=pki.root_pem())
    doc = json.loads(render_dev_host(with_root.host).text)
    assert doc["simulated_root"] == pki.root_pem()
    assert doc["forwarder"]["simulated_root"] == "/run/umbra/launch/forwarder/simulated-root.der"
    again = dev_definition(allow_simulated=True, simulated_root=other.root_pem())
    assert measure(with_root).compose_hash != measure(again).compose_hash
    with pytest.raises(DefinitionError, match="simulated_root is the anchor for allow_simulated"):
        dev_definition(simulated_root=pki.root_pem())

    host = load_dev_host(render_dev_host(with_root.host).text)
    target = tmp_path / "launch" / "forwarder" / "simulated-root.der"
    forwarder = host.forwarder.model_copy(update={"simulated_root": target})
    dev = DevHost(host.model_copy(update={"forwarder": forwarder}), "cvm_x", tmp_path, tmp_path)
    _write_simulated_root(dev)
    assert target.read_bytes() == pki.root_der and target.stat().st_mode & 0o777 == 0o644
