"""Loading a policy directory: every profile and test suite, validated and compiled, or nothing.

Every problem in every file is collected before anything is returned, each with its file, line and
field, so one run of `umbra policy check` shows the whole list.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from umbra.policy.compiled import (
    CompiledProfile,
    DuplicateRuleId,
    UnknownRule,
    compile_profile,
)
from umbra.policy.compose import CompositionError, EffectivePolicy
from umbra.policy.errors import PolicyError, PolicyIssue
from umbra.policy.model import API_VERSION, Profile
from umbra.policy.source import LocatedDict, field_path, line_of, load_yaml
from umbra.policy.suite import Suite

POLICY_SUFFIXES = (".yaml", ".yml")
_KINDS: Mapping[str, type[BaseModel]] = {"Profile": Profile, "PolicyTest": Suite}


@dataclass(frozen=True)
class LoadedProfile:
    file: str
    profile: Profile
    compiled: CompiledProfile
    rule_lines: dict[str, int | None]


@dataclass(frozen=True)
class LoadedSuite:
    file: str
    suite: Suite
    case_lines: list[int | None]


@dataclass
class PolicySet:
    root: Path
    profiles: dict[str, LoadedProfile] = field(default_factory=dict)
    suites: list[LoadedSuite] = field(default_factory=list)

    def compose(
        self, names: Iterable[str], *, file: str = "", line: int | None = None
    ) -> EffectivePolicy:
        """Compose the named profiles; errors point at the rule responsible."""
        issues: list[PolicyIssue] = []
        selected: list[CompiledProfile] = []
        for name in names:
            loaded = self.profiles.get(name)
            if loaded is None:
                issues.append(PolicyIssue(file, line, "profiles", f"no profile named {name!r}"))
            else:
                selected.append(loaded.compiled)
        if issues:
            raise PolicyError(issues)
        try:
            return EffectivePolicy(selected)
        except CompositionError as exc:
            raise PolicyError(
                [
                    self._locate(conflict.rule_id, conflict.message, conflict.field)
                    for conflict in exc.conflicts
                ]
            ) from None

    def compose_all(self) -> EffectivePolicy:
        return self.compose(sorted(self.profiles))

    def _locate(self, rule_id: str, message: str, field: str = "") -> PolicyIssue:
        loaded = self.profiles.get(rule_id.split(":", 1)[0])
        if loaded is None:
            return PolicyIssue(str(self.root), None, rule_id, message)
        where = rule_id
        index = next((i for i, r in enumerate(loaded.compiled.inject) if r.id == rule_id), None)
        if field and index is not None:
            # Name the field as written: `basic` and `header` compile to headers too.
            rule = loaded.profile.inject[index]
            written = {"headers": "basic" if rule.basic else "header" if rule.header else field}
            where = f"{rule_id}: inject[{index}].{written.get(field, field)}"
        return PolicyIssue(loaded.file, loaded.rule_lines.get(rule_id), where, message)


def policy_files(root: Path) -> list[Path]:
    return sorted(
        path for path in root.rglob("*") if path.suffix in POLICY_SUFFIXES and path.is_file()
    )


def load_policy_dir(root: Path, display_root: str | None = None) -> PolicySet:
    """Load, validate and compile every policy file under `root`; raise PolicyError listing all problems."""
    if not root.is_dir():
        raise PolicyError.single(str(root), None, "", "not a directory")
    result = PolicySet(root=root)
    issues: list[PolicyIssue] = []
    for path in policy_files(root):
        name = str(Path(display_root) / path.relative_to(root)) if display_root else str(path)
        try:
            _load_file(path, name, result)
        except PolicyError as exc:
            issues.extend(exc.issues)
    if issues:
        raise PolicyError(issues)
    return result


def _load_file(path: Path, name: str, into: PolicySet) -> None:
    data = load_yaml(path, name)
    if not isinstance(data, LocatedDict):
        raise PolicyError.single(name, None, "", "expected a mapping with apiVersion and kind")
    if data.get("apiVersion") != API_VERSION:
        line = data.key_lines.get("apiVersion", data.line)
        raise PolicyError.single(name, line, "apiVersion", f"must be {API_VERSION!r}")
    kind = data.get("kind")
    model = _KINDS.get(kind) if isinstance(kind, str) else None
    if model is None:
        line = data.key_lines.get("kind", data.line)
        raise PolicyError.single(name, line, "kind", f"must be one of {sorted(_KINDS)}")
    document = _validate(model, data, name)
    if isinstance(document, Profile):
        _add_profile(document, data, name, into)
    elif isinstance(document, Suite):
        lines = [line_of(data, ("cases", index)) for index in range(len(document.cases))]
        into.suites.append(LoadedSuite(name, document, lines))


def _validate(model: type[BaseModel], data: Any, name: str) -> BaseModel:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise PolicyError(
            [
                PolicyIssue(
                    name,
                    line_of(data, error["loc"]),
                    field_path(error["loc"]),
                    _message(error["msg"]),
                )
                for error in exc.errors()
            ]
        ) from None


def _message(text: str) -> str:
    return text.removeprefix("Value error, ")


def _add_profile(profile: Profile, data: Any, name: str, into: PolicySet) -> None:
    if profile.name in into.profiles:
        first = into.profiles[profile.name].file
        raise PolicyError.single(
            name,
            line_of(data, ("name",)),
            "name",
            f"profile {profile.name!r} is also defined in {first}",
        )
    try:
        compiled, origins = compile_profile(profile)
    except DuplicateRuleId as exc:
        loc = (exc.section, exc.index, "id")
        raise PolicyError.single(name, line_of(data, loc), field_path(loc), str(exc)) from None
    except UnknownRule as exc:
        loc = (exc.section, exc.index, "rules")
        raise PolicyError.single(name, line_of(data, loc), field_path(loc), str(exc)) from None
    rule_lines = {rule_id: line_of(data, origin) for rule_id, origin in origins.items()}
    into.profiles[profile.name] = LoadedProfile(name, profile, compiled, rule_lines)
