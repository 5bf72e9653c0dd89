"""Shortcuts on the hot path, each leaning on one thing anyio, asyncio or logging does today.

A backend is bound to one event loop, so what anyio looks up on every call (the running
back-end) is looked up once, when the backend opens. ``tests/test_fastpath.py`` fails
if the library behaviour a shortcut leans on changes.
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import Any, cast

import anyio
import anyio.lowlevel


def _checkpoint_if_cancelled_for(
    scope_type: type[anyio.CancelScope],
) -> Callable[[], Awaitable[None]]:
    """``anyio.lowlevel.checkpoint_if_cancelled`` without its per-call event loop lookup.

    A backend is bound to one event loop, so the loop's anyio back-end class (found the
    way anyio finds it: the ``backend_class`` of the module defining its cancel scope) is
    looked up once; the public function is the fallback if that ever changes.
    """
    backend_class = getattr(sys.modules.get(scope_type.__module__), "backend_class", None)
    method = getattr(backend_class, "checkpoint_if_cancelled", None)
    if callable(method):
        return cast(Callable[[], Awaitable[None]], method)
    return anyio.lowlevel.checkpoint_if_cancelled


def _any_current_task() -> object:
    return anyio.get_current_task().id


def _current_task_function(scope_type: type[anyio.CancelScope]) -> Callable[[], object]:
    """A cheap way to name the running task on the event loop whose cancel scope class is
    ``scope_type`` (the anyio back-end is known once the backend opens)."""
    module = scope_type.__module__
    if module.endswith("._asyncio"):
        import asyncio
        import inspect

        loop = asyncio.get_running_loop()
        # Python 3.11's asyncio.current_task is Python around the dict the C tasks keep
        # the running task of each loop in: read the dict itself (no Python frame per
        # call), once the dict is seen to name this very task. Later Pythons' function
        # is C already, and may keep the task elsewhere.
        running = getattr(asyncio.tasks, "_current_tasks", None)
        if (
            inspect.isfunction(asyncio.current_task)
            and isinstance(running, dict)
            and running.get(loop) is asyncio.current_task(loop) is not None
        ):
            return functools.partial(running.get, loop)
        # Passing the loop skips the running-loop lookup (half the cost of the call).
        return functools.partial(asyncio.current_task, loop)
    if module.endswith("._trio"):
        lowlevel = importlib.import_module("trio.lowlevel")  # present: trio is running
        return cast(Callable[[], object], lowlevel.current_task)
    return _any_current_task


#: ``new_scope(scope_type)``: a fresh cancel scope, ``scope_type()`` without the class
#: call. anyio's back-end scope classes define ``__new__`` in Python only to return
#: ``object.__new__(cls)`` (undoing the base class's dispatch to the running back-end), and
#: calling a class with a Python ``__new__`` and ``__init__`` makes two calls from C into
#: Python: about 1,600 instructions of a 115 k hold. ``_new_object(cls)`` then
#: ``scope.__init__()`` makes the same scope (the hold writes these two lines inline).
_new_object = object.__new__


def new_scope(scope_type: type[anyio.CancelScope]) -> anyio.CancelScope:
    scope = _new_object(scope_type)
    scope.__init__()  # type: ignore[misc]
    return scope


def _called(scope_type: type[anyio.CancelScope]) -> anyio.CancelScope:
    return scope_type()


def scope_maker(scope_type: type[anyio.CancelScope]) -> Callable[[type[Any]], Any]:
    """``_new_object`` where the shortcut makes the same scope as the class call (checked
    once, when a backend opens, on the anyio installed: its ``__new__`` must only make
    the object and ``__init__`` set every slot); else the class call itself (then the
    hold's ``__init__()`` after it runs twice on a fresh scope, which changes nothing)."""
    if "__new__" not in vars(scope_type):
        return _called
    made, called = new_scope(scope_type), scope_type()
    for cls in scope_type.__mro__:
        for slot in getattr(cls, "__slots__", ()):
            name = f"_{cls.__name__.lstrip('_')}{slot}" if slot.startswith("__") else slot
            if hasattr(made, name) != hasattr(called, name):
                return _called
            if hasattr(called, name) and type(getattr(made, name)) is not type(
                getattr(called, name)
            ):
                return _called
    return _new_object


def _level_cache(logger: logging.Logger) -> dict[int, bool]:
    """The dict ``logger.isEnabledFor`` keeps its answers in, by level: ``cache.get(level,
    True)`` is False only where the call would answer False, with no Python call.

    logging empties that very dict whenever a level changes (``setLevel`` on any logger,
    ``logging.disable``), as it relies on itself; a logger's ``disabled`` flag only turns
    answers False, so a True (or missing) entry still asks ``isEnabledFor``. If logging
    ever keeps no such dict, an empty one stands in: ``isEnabledFor`` is then always asked.
    """
    cache = getattr(logger, "_cache", None)
    return cache if isinstance(cache, dict) else {}


def _describe_loop() -> str:
    import asyncio

    thread = threading.current_thread()
    try:
        loop = asyncio.get_running_loop()
        where = f"{type(loop).__name__} {id(loop):#x}"
    except RuntimeError:
        where = "the event loop"  # trio, or not in an event loop at all
    return f"{where} in thread {thread.name!r} ({thread.ident})"
