"""The one strict base (`contracts.model.Strict`) and the one way to word a pydantic refusal
(`contracts.validation`): field path and message, never the input."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from umbra.contracts.model import Strict
from umbra.contracts.validation import first_problem, lines, location, problems


class Inner(Strict):
    port: int


class Doc(Strict):
    name: str
    inner: list[Inner]


def _refusal(doc: object) -> ValidationError:
    with pytest.raises(ValidationError) as error:
        Doc.model_validate(doc)
    return error.value


def test_strict_refuses_unknown_fields_and_is_frozen() -> None:
    assert "extra_forbidden" in str(_refusal({"name": "a", "inner": [], "x": 1}))
    doc = Doc(name="a", inner=[])
    with pytest.raises(ValidationError):
        doc.name = "b"


def test_locations_and_messages_never_the_input() -> None:
    secret = "s3cr3t-value-in-the-input"
    exc = _refusal({"name": 5, "inner": [{"port": secret}]})
    assert lines(exc) == [
        "name: Input should be a valid string",
        "inner.0.port: Input should be a valid integer, unable to parse string as an integer",
    ]
    assert problems(exc, sep=" | ").count(" | ") == 1
    assert first_problem(exc) == "name: Input should be a valid string"
    assert secret not in problems(exc) and secret not in first_problem(exc)
    assert location((), "(top level)") == "(top level)" and location(("a", 0)) == "a.0"
    top = _refusal([1])
    assert first_problem(top) == lines(top, "doc")[0].removeprefix("doc: ")
