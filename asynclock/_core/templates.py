"""Lock names made from a call's arguments: ``"report:{customer_id}"``.

Every integration (Celery tasks, FastAPI routes, APScheduler jobs, ``locked_function``)
formats a lock name from the arguments of the call it guards, and must refuse a template
that names an argument the callable does not have when it is *defined*, not when it runs.
"""

from __future__ import annotations

import inspect
import string
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .validation import check_name

_FORMATTER = string.Formatter()


class NameTemplate:
    """A lock-name template with ``str.format`` fields naming arguments: ``"acct:{id}"``.

    Fields may use attributes, indexes and format specs (``"{user.id}"``, ``"{day:%Y-%m-%d}"``);
    positional fields (``"{}"``, ``"{0}"``) are refused: arguments are matched by name.

    Raises:
        TypeError: ``template`` is not a str.
        ValueError: it is empty, malformed, or has a positional field.
    """

    __slots__ = ("fields", "template")

    def __init__(self, template: str) -> None:
        if not isinstance(template, str):
            raise TypeError(
                f"lock name template must be a str like 'report:{{customer_id}}', "
                f"not {type(template).__name__}"
            )
        if not template:
            raise ValueError("lock name template must be a non-empty str")
        try:
            parsed = list(_FORMATTER.parse(template))
        except ValueError as exc:
            raise ValueError(f"malformed lock name template {template!r}: {exc}") from None
        fields: list[str] = []
        for _, field, _, _ in parsed:
            if field is None:
                continue
            root = field.split(".", 1)[0].split("[", 1)[0]
            if not root or root.isdigit():
                raise ValueError(
                    f"lock name template {template!r} has a positional field {{{field}}}; "
                    "name the argument instead, e.g. {customer_id}"
                )
            if root not in fields:
                fields.append(root)
        self.template = template
        #: The argument names the template uses, in order of first use.
        self.fields: tuple[str, ...] = tuple(fields)

    def __repr__(self) -> str:
        return f"NameTemplate({self.template!r})"

    def check_parameters(self, parameters: Iterable[str], *, what: str = "the function") -> None:
        """Raise ``TypeError`` if a field names none of ``parameters``."""
        known = set(parameters)
        missing = [field for field in self.fields if field not in known]
        if missing:
            shown = ", ".join(sorted(known)) or "none"
            raise TypeError(
                f"lock name template {self.template!r} uses {', '.join(missing)}, which "
                f"{what} does not take (its parameters: {shown})"
            )

    def check_callable(self, func: Callable[..., Any], *, what: str | None = None) -> None:
        """Raise ``TypeError`` if a field names no parameter of ``func``.

        A ``**kwargs`` parameter accepts any field.
        """
        signature = inspect.signature(func)
        if any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
            return
        label = what or f"{getattr(func, '__qualname__', func)!s}()"
        self.check_parameters(signature.parameters, what=label)

    def format(self, arguments: Mapping[str, Any]) -> str:
        """The lock name for these named arguments (a valid lock name, or ValueError)."""
        try:
            name = self.template.format_map(arguments)
        except KeyError as exc:
            raise TypeError(
                f"lock name template {self.template!r} needs argument {exc.args[0]!r}"
            ) from None
        except (AttributeError, IndexError, ValueError) as exc:
            raise ValueError(f"cannot format lock name template {self.template!r}: {exc}") from exc
        return check_name(name)

    def format_call(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> str:
        """The lock name for a call ``func(*args, **kwargs)``, defaults applied."""
        bound = inspect.signature(func).bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        for param in inspect.signature(func).parameters.values():
            if param.kind is param.VAR_KEYWORD and param.name in arguments:
                arguments.update(arguments.pop(param.name))
        return self.format(arguments)
