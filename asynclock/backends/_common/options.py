"""The options a backend takes from its URL's query and from ``connect()``'s keywords.

Each backend declares them once (:class:`Options`); an unknown or clashing one fails the
same way on every backend, before any I/O: a URL option is configuration text, so it is a
ValueError; a keyword is a call argument, so it is a TypeError, as for any unexpected
keyword argument. Both name the scheme, the option and what is allowed.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field

from ..._core.validation import check_seconds


def check_restart_grace(value: object) -> float | None:
    """``restart_grace`` (Redis, Redlock, ZooKeeper): None (the ttl of the first acquire
    the grace applies to) or seconds >= 0 (0: none)."""
    if value is None:
        return None
    return check_seconds(value, "restart_grace", zero=True, text=True)


def _listed(names: Collection[str]) -> str:
    """Names as a message lists them: in the order declared (a tuple), else sorted."""
    ordered = names if isinstance(names, tuple | list) else sorted(names, key=str.lower)
    return ", ".join(ordered) if ordered else "none"


def _quoted(names: list[str]) -> str:
    return ", ".join(map(repr, names))


@dataclass(frozen=True, slots=True)
class Options:
    """What one backend's URL query and keywords may carry.

    ``query``: the names a URL query may carry; ``keywords``: the names ``connect()`` may
    pass on to the driver; ``managed``: names asynclock sets itself, each with what it
    sets and why (refused in both places); ``custom``: other query names let through (a
    PostgreSQL custom setting ``app.name``), described by ``custom_text``.
    """

    scheme: str
    query: Collection[str]
    keywords: Collection[str]
    managed: Mapping[str, str] = field(default_factory=dict)
    custom: Callable[[str], bool] | None = None
    custom_text: str = ""

    def check(
        self, query: Iterable[tuple[str, str]], keywords: Mapping[str, object] | None = None
    ) -> None:
        """Raise for the first clash, then for every unknown name at once."""
        label = f"{self.scheme}://"
        pairs = list(query)
        for key, value in pairs:
            if key in self.managed:
                raise ValueError(
                    f"{label} URL option {key}={value} clashes with {self.managed[key]}; "
                    "remove it from the URL"
                )
        unknown = [
            key
            for key in dict.fromkeys(key for key, _ in pairs)
            if key not in self.query and not (self.custom is not None and self.custom(key))
        ]
        if unknown:
            tail = f", {self.custom_text}" if self.custom_text else ""
            raise ValueError(
                f"unknown {label} URL option{'s' if len(unknown) > 1 else ''} "
                f"{_quoted(unknown)}; allowed: {_listed(self.query)}{tail}"
            )
        keywords = keywords or {}
        for key, given in keywords.items():
            if key in self.managed:
                raise ValueError(
                    f"{label} option {key}={given!r} clashes with {self.managed[key]}; "
                    "do not pass it"
                )
        unknown = [key for key in keywords if key not in self.keywords]
        if unknown:
            allowed = (
                f"allowed: {_listed(self.keywords)}"
                if self.keywords
                else f"{label} takes no options"
            )
            raise TypeError(
                f"unknown {label} option{'s' if len(unknown) > 1 else ''} "
                f"{_quoted(unknown)}; {allowed}"
            )
