"""A locked task's lease options, checked where the task is declared, and its lock name."""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import asynclock

#: What a run does when the lock is held by someone else (the first is the default).
ON_BUSY = ("wait", "retry", "skip", "fail")
#: ``on_busy="retry"``: the first countdown is up to this many seconds; it doubles with
#: each retry (``self.request.retries``), with jitter, up to ``RETRY_BACKOFF_MAX``.
RETRY_BACKOFF = 1.0
RETRY_BACKOFF_MAX = 60.0


def _check_ttl(ttl: object, what: str) -> float:
    """A lease ttl, checked where it is declared by the rules the core applies at acquire
    (with ``asynclock.connect``'s default drift and margin)."""
    return asynclock.check_seconds(ttl, what, lease=True)


def _check_on_busy(on_busy: object) -> str:
    if not isinstance(on_busy, str) or on_busy not in ON_BUSY:
        raise ValueError(f"on_busy must be one of {', '.join(map(repr, ON_BUSY))}, got {on_busy!r}")
    return on_busy


def _check_timeout(timeout: object, on_busy: str, what: str) -> float | None:
    if timeout is None:
        return None
    try:
        f = asynclock.check_seconds(timeout, what, zero=True)
    except ValueError:
        raise ValueError(
            f"{what} must be None (wait as long as it takes) or a finite number of "
            f"seconds >= 0, got {timeout!r}"
        ) from None
    if on_busy != "wait":
        raise ValueError(
            f"{what} bounds the wait of on_busy='wait'; with on_busy={on_busy!r} nothing "
            f"waits: leave {what} unset or use on_busy='wait'"
        )
    return f


def _check_backoff(backoff: object, backoff_max: object, what: str) -> tuple[float, float]:
    first = asynclock.check_seconds(backoff, what)
    cap = asynclock.check_seconds(backoff_max, f"{what}_max")
    if cap < first:
        raise ValueError(f"{what}_max ({cap:g}s) must be at least {what} ({first:g}s)")
    return first, cap


@dataclass(frozen=True)
class Policy:
    """A locked task's lease options, checked when the task is declared."""

    ttl: float = 60.0
    on_busy: str = ON_BUSY[0]
    timeout: float | None = None
    backoff: float = RETRY_BACKOFF
    backoff_max: float = RETRY_BACKOFF_MAX

    def countdown(self, retries: int) -> float:
        """Exponential backoff with "equal jitter": half the step is certain, so a few
        retries always span a known time; the other half spreads the runs apart."""
        step = min(self.backoff_max, self.backoff * 2.0 ** min(retries, 64))
        return round(step / 2 + random.uniform(0, step / 2), 3)


Namer = Callable[[tuple[Any, ...], dict[str, Any]], str]


def _namer(template: asynclock.NameTemplate, func: Callable[..., Any]) -> Namer:
    """The lock name of a call ``func(*args, **kwargs)``, as ``template.format_call``
    gives it, without binding through ``inspect`` on each call (about 30 µs, measured)
    when the call fits a plain signature, as most do.

    Any other call (``*args``, ``**kwargs`` or positional-only parameters, too many or
    unknown arguments, a missing one) goes through ``format_call``, which raises the
    ``TypeError`` the call itself would.
    """

    def slow(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        return template.format_call(func, args, kwargs)

    params = list(inspect.signature(func).parameters.values())
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY) for p in params):
        return slow
    positional = tuple(p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD)
    known = frozenset(p.name for p in params)
    required = frozenset(p.name for p in params if p.default is p.empty)
    defaults = {p.name: p.default for p in params if p.default is not p.empty}

    def fast(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        if len(args) > len(positional):
            return slow(args, kwargs)
        arguments = dict(zip(positional, args, strict=False))
        if kwargs:
            if not known.issuperset(kwargs) or not arguments.keys().isdisjoint(kwargs):
                return slow(args, kwargs)
            arguments.update(kwargs)
        if len(arguments) < len(known):
            if not required.issubset(arguments):
                return slow(args, kwargs)
            for key, value in defaults.items():
                arguments.setdefault(key, value)
        return template.format(arguments)

    return fast


def _policy(
    ttl: object,
    on_busy: object,
    timeout: object,
    backoff: object,
    backoff_max: object,
    names: tuple[str, str, str],
) -> Policy:
    """The options of a task as declared, checked (``names``: how the user spells the
    ttl, the timeout and the backoff options)."""
    busy = _check_on_busy(on_busy)
    first, cap = _check_backoff(backoff, backoff_max, names[2])
    return Policy(
        _check_ttl(ttl, names[0]), busy, _check_timeout(timeout, busy, names[1]), first, cap
    )
