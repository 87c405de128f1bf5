"""Policy errors that say where: file, line and field."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PolicyIssue:
    file: str
    line: int | None
    field: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line is not None else self.file
        field = f" {self.field}:" if self.field else ""
        return f"{where}:{field} {self.message}"

    def as_dict(self) -> dict[str, object]:
        return {"file": self.file, "line": self.line, "field": self.field, "message": self.message}


class PolicyError(Exception):
    """One or more problems in policy files; nothing is applied when any is raised."""

    def __init__(self, issues: list[PolicyIssue]) -> None:
        if not issues:
            raise ValueError("PolicyError needs at least one issue")
        self.issues = issues
        super().__init__("\n".join(str(issue) for issue in issues))

    @classmethod
    def single(cls, file: str, line: int | None, field: str, message: str) -> PolicyError:
        return cls([PolicyIssue(file, line, field, message)])
