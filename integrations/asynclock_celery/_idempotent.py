"""Idempotent tasks: a run keyed by its arguments replays the stored result of the run that
completed before, instead of running the body again (``asynclock.from_thread.idempotent``
on the worker's loop thread; the rules are ``asynclock.idempotency``'s, docs/idempotency.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery import Task

import asynclock.idempotency
from asynclock.idempotency import KeyedCalls


def check_idempotency(
    key: str | None,
    fingerprint: object,
    keep: object,
    store_errors: object,
    func: Callable[..., Any] | None,
    names: tuple[str, str, str, str],
) -> KeyedCalls:
    """The options as declared, checked (``names``: how the user spells the key, the
    fingerprint, keep and store_errors options). ``key`` None: the task's name and a hash
    of all its arguments; ``fingerprint`` None: all of them."""
    calls = KeyedCalls.declare(
        key, fingerprint=fingerprint, keep=keep, store_errors=store_errors, names=names[1:]
    )
    if func is not None:
        what = f"task {getattr(func, '__qualname__', func)!s}()"
        calls.check_function(func, what, names[1])
    return calls


def arguments_of(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The call's arguments by name (``asynclock.idempotency.arguments_of``), the task
    itself (``bind=True`` under ``@locked``) left out."""
    arguments = asynclock.idempotency.arguments_of(func, args, kwargs)
    return {n: v for n, v in arguments.items() if not isinstance(v, Task)}
