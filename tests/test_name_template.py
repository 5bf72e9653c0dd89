"""``asynclock.NameTemplate``: lock names from a call's arguments, checked at definition."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from asynclock import NameTemplate


def report(customer_id: int, day: str = "today", *, fast: bool = False) -> None:
    pass


def test_fields_and_formatting_from_a_call() -> None:
    template = NameTemplate("report:{customer_id}:{day}")
    assert template.fields == ("customer_id", "day")
    template.check_callable(report)
    assert template.format_call(report, (7,), {}) == "report:7:today"
    assert template.format_call(report, (), {"customer_id": 8, "day": "mon"}) == "report:8:mon"


def test_attributes_indexes_and_specs() -> None:
    @dataclasses.dataclass
    class User:
        id: int

    def f(user: User, ids: list[int], n: float) -> None:
        pass

    template = NameTemplate("u:{user.id}:{ids[0]}:{n:.1f}")
    template.check_callable(f)
    assert template.format_call(f, (User(3), [9], 2.25), {}) == "u:3:9:2.2"


def test_a_field_the_function_lacks_is_a_type_error_at_definition() -> None:
    with pytest.raises(TypeError, match=r"uses account, which report\(\) does not take"):
        NameTemplate("sync:{account}").check_callable(report)


def test_var_keyword_accepts_any_field() -> None:
    def f(**kwargs: Any) -> None:
        pass

    template = NameTemplate("x:{anything}")
    template.check_callable(f)
    assert template.format_call(f, (), {"anything": 1}) == "x:1"


@pytest.mark.parametrize(
    ("template", "error", "match"),
    [
        (3, TypeError, "must be a str"),
        ("", ValueError, "non-empty"),
        ("a:{", ValueError, "malformed"),
        ("a:{}", ValueError, "positional field"),
        ("a:{0}", ValueError, "positional field"),
    ],
)
def test_bad_templates(template: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        NameTemplate(template)


def test_formatted_name_is_validated() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        NameTemplate("{x}").format({"x": ""})
    with pytest.raises(TypeError, match="needs argument 'x'"):
        NameTemplate("{x}").format({})
