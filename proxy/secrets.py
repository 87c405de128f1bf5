"""The secret values the proxy holds, and the placeholders the sandbox sees in their stead.

Secrets are referenced as `team/<name>` (one value for the team) or `personal/<name>` (one value per
CVM owner). A sandbox never holds a value; tools there may carry a placeholder
`umbra-placeholder:<ref>`, which the proxy replaces by injecting the real header only for the hosts
the policy binds that secret to, and refuses to forward anywhere else.

Local mode loads a secrets file (YAML or JSON, mode 0600):
    team: {github-bot: "..."}
    personal: {alice: {openai: "..."}, bob: {openai: "..."}}
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from umbra.contracts.secret_kinds import (
    AwsSigv4,
    MintedMaterial,
    SecretKind,
    StaticSecret,
    parse_material,
)
from umbra.contracts.validation import problems

PLACEHOLDER_PREFIX = "umbra-placeholder:"
PLACEHOLDER_PATTERN = r"umbra-placeholder:((?:team|personal)/[a-z0-9._-]{1,128})"
_NAME = re.compile(r"^[a-z0-9](?:[a-z0-9._-]{0,126}[a-z0-9])?$")


class SecretsError(Exception):
    """A secrets source that cannot be used (the message never contains a secret value)."""


@dataclass(frozen=True, slots=True)
class SecretValue:
    ref: str  # e.g. team/github-bot or personal/alice/openai (owner-qualified for scanning)
    value: str

    def __repr__(self) -> str:
        return f"SecretValue(ref={self.ref!r}, value=<redacted>)"


def placeholder(ref: str) -> str:
    return PLACEHOLDER_PREFIX + ref


class _SecretsFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    # A value, or a kind's document (an object with "kind", contracts/secret_kinds.py).
    team: dict[str, str | dict[str, object]] = {}
    personal: dict[str, dict[str, str | dict[str, object]]] = {}


def _split(
    path: Path, parsed: _SecretsFile
) -> tuple[dict[str, str], dict[str, dict[str, str]], dict[SecretKey, Material]]:
    """Static values apart from kinds' documents (parsed, version 1: the file has no versions)."""
    team: dict[str, str] = {}
    personal: dict[str, dict[str, str]] = {}
    materials: dict[SecretKey, Material] = {}
    entries = [(None, name, value) for name, value in parsed.team.items()] + [
        (owner, name, value)
        for owner, values in parsed.personal.items()
        for name, value in values.items()
    ]
    for owner, name, value in entries:
        ref = f"{'team' if owner is None else 'personal'}/{name}"
        if isinstance(value, str):
            (team if owner is None else personal.setdefault(owner, {}))[name] = value
            continue
        try:
            document = parse_material(SecretKind(str(value.get("kind"))), json.dumps(value))
        except (ValueError, ValidationError) as exc:
            where = problems(exc) if isinstance(exc, ValidationError) else str(exc)
            raise SecretsError(f"{path}: secret {ref}: {where}") from None
        if isinstance(document, StaticSecret):
            (team if owner is None else personal.setdefault(owner, {}))[name] = document.value
        else:
            materials[(ref, owner)] = Material(document, 1)
    return team, personal, materials


# (ref, owner or None) -> the hosts a secret may be sent to, as bound at the Console.
HostBindings = dict[tuple[str, str | None], frozenset[str]]
# (ref, owner or None): one secret as the Security CVM knows it (owner None for team secrets).
SecretKey = tuple[str, str | None]


@dataclass(frozen=True, slots=True)
class Material:
    """A secret of a kind other than static: its document, the Console's version of it (a
    rotation written back must name the version it replaces) and whether it needs a new login."""

    document: MintedMaterial | AwsSigv4
    version: int
    needs_login: bool = False

    def __repr__(self) -> str:
        return f"Material(kind={self.document.kind}, version={self.version}, value=<redacted>)"


class SecretStore:
    def __init__(
        self,
        team: dict[str, str],
        personal: dict[str, dict[str, str]],
        hosts: HostBindings | None = None,
        materials: dict[SecretKey, Material] | None = None,
    ) -> None:
        for name in [*team, *(name for values in personal.values() for name in values)]:
            if not _NAME.match(name):
                raise SecretsError(f"secret name {name[:64]!r} is not a valid name")
        self._team = dict(team)
        self._personal = {owner: dict(values) for owner, values in personal.items()}
        # None: a local secrets file, bound to hosts by the policy's inject rules alone.
        self._hosts = hosts
        self._materials = dict(materials or {})

    @classmethod
    def empty(cls) -> SecretStore:
        return cls({}, {})

    @classmethod
    def from_file(cls, path: Path) -> SecretStore:
        try:
            mode = path.stat().st_mode
            if mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise SecretsError(
                    f"{path}: secrets file is readable by group or others "
                    f"(mode {stat.S_IMODE(mode):o}); chmod 600 it"
                )
            text = path.read_text()
        except OSError as exc:
            raise SecretsError(f"{path}: cannot read secrets file ({exc.strerror})") from None
        try:
            data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
            parsed = _SecretsFile.model_validate(data or {})
        except (ValueError, yaml.YAMLError) as exc:
            where = ""
            if isinstance(exc, ValidationError):
                where = ": at " + ".".join(str(p) for p in exc.errors()[0]["loc"][:2])
            raise SecretsError(f"{path}: not a valid secrets file{where}") from None
        team, personal, materials = _split(path, parsed)
        return cls(team, personal, materials=materials)

    @staticmethod
    def key(ref: str, owner: str) -> SecretKey:
        return (ref, owner if ref.startswith("personal/") else None)

    def material(self, ref: str, owner: str, host: str) -> Material | None:
        """The document of a minted or signing secret for a request to `host`, as `resolve`."""
        key = self.key(ref, owner)
        found = self._materials.get(key)
        if found is None or self._hosts is None or key not in self._hosts:
            return found
        return found if host in self._hosts[key] else None

    def material_of(self, key: SecretKey) -> Material | None:
        return self._materials.get(key)

    def materials(self) -> dict[SecretKey, Material]:
        return dict(self._materials)

    def resolve(self, ref: str, owner: str, host: str) -> str | None:
        """The value of `team/x`, or of `personal/x` for this CVM owner, for a request to `host`;
        None when absent or when the secret is bound to other hosts."""
        kind, _, name = ref.partition("/")
        key: tuple[str, str | None]
        if kind == "team":
            value, key = self._team.get(name), (ref, None)
        elif kind == "personal":
            value, key = self._personal.get(owner, {}).get(name), (ref, owner)
        else:
            return None
        if value is None or self._hosts is None or key not in self._hosts:
            return value
        return value if host in self._hosts[key] else None

    def all_values(self) -> list[SecretValue]:
        values = [SecretValue(f"team/{name}", value) for name, value in sorted(self._team.items())]
        for owner, secrets in sorted(self._personal.items()):
            values.extend(
                SecretValue(f"personal/{owner}/{name}", value)
                for name, value in sorted(secrets.items())
            )
        # Every secret field of a document (refresh tokens, client secrets, private keys, AWS
        # secret keys) is scanned for like a static value.
        for (ref, holder), material in sorted(self._materials.items(), key=lambda i: str(i[0])):
            scoped = ref if holder is None else f"personal/{holder}/{ref.partition('/')[2]}"
            values.extend(SecretValue(scoped, value) for value in material.document.sensitive())
        return values

    def fingerprint(self) -> int:
        return hash(tuple((item.ref, item.value) for item in self.all_values())) ^ os.getpid()
