"""Inputs shared by the sandbox and images tests: example digests, never real images."""

from __future__ import annotations

import hashlib
from typing import Any

from umbra.images.definition import (
    DevCvmDefinition,
    SecurityCvmDefinition,
    parse_definition,
)
from umbra.images.measure import measure
from umbra.sandbox import image

BUNDLE_KEY = (
    "-----BEGIN PUBLIC KEY-----\n"
    "MCowBQYDK2VwAyEAGb9ECWmEzf6FQbrBZ9w7lshQhqowtrbLDFw4rXAxZuE=\n"
    "-----END PUBLIC KEY-----\n"
)


def digest_ref(name: str) -> str:
    return f"registry.example/umbra/{name}@sha256:{hashlib.sha256(name.encode()).hexdigest()}"


def security_definition_doc(**compose: Any) -> dict[str, Any]:
    return {
        "apiVersion": "umbra/v1",
        "kind": "ImageDefinition",
        "role": "security-cvm",
        "tee": "simulated",
        "base": {"simulated_image": "umbra-security-cvm"},
        "compose": {
            "release": "security-cvm-test",
            "images": {
                "proxy": digest_ref("proxy"),
            },
            "console_url": "https://console.example",
            "bundle_keys": [BUNDLE_KEY],
            **compose,
        },
    }


def security_definition(**compose: Any) -> SecurityCvmDefinition:
    d = parse_definition(security_definition_doc(**compose))
    assert isinstance(d, SecurityCvmDefinition)
    return d


def dev_definition_doc(**host: Any) -> dict[str, Any]:
    sec = measure(security_definition())
    return {
        "apiVersion": "umbra/v1",
        "kind": "ImageDefinition",
        "role": "dev-cvm",
        "tee": "simulated",
        "base": {"simulated_image": "umbra-dev-cvm"},
        "host": {
            "release": "dev-cvm-test",
            "sandbox_image": {"recipe_key": image.recipe_key(), "files_key": image.files_key()},
            "security_cvm": {"host": "security.example", "port": 8443},
            "security_cvm_release": sec.release.model_dump(mode="json", exclude_none=True),
            "pccs_urls": ["https://pccs.example/sgx/certification/v4"],
            "console_url": "https://console.example",
            "tunnels": [
                {"name": "github-ssh", "listen_port": 2201, "host": "github.com", "port": 22}
            ],
            **host,
        },
    }


def dev_definition(**host: Any) -> DevCvmDefinition:
    d = parse_definition(dev_definition_doc(**host))
    assert isinstance(d, DevCvmDefinition)
    return d
