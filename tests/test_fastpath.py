"""The hot path's shortcuts (asynclock/_core/fastpath.py) and what they lean on in anyio.

Each test fails when the library behaviour a shortcut relies on changes, so that the
shortcut is revisited (or dropped for the public call) instead of silently falling back.
"""

from __future__ import annotations

import sys

import anyio
import anyio.lowlevel
import pytest

from asynclock._core.fastpath import (
    _any_current_task,
    _checkpoint_if_cancelled_for,
    _current_task_function,
    new_scope,
)

pytestmark = pytest.mark.anyio

LOOPS = pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])


@LOOPS
async def test_a_cancel_scope_is_the_running_loops_own_class() -> None:
    """Holder scopes are made with ``type(anyio.CancelScope())`` once the backend opens:
    anyio must hand out its running back-end's subclass, defined next to that back-end."""
    scope_type = type(anyio.CancelScope())
    assert scope_type is not anyio.CancelScope
    assert issubclass(scope_type, anyio.CancelScope)
    backend_class = getattr(sys.modules[scope_type.__module__], "backend_class", None)
    assert backend_class is not None, "anyio moved its back-end class: revisit fastpath.py"
    with scope_type() as scope:  # made directly, it still cancels like anyio's
        scope.cancel()
        await anyio.lowlevel.checkpoint()
    assert scope.cancelled_caught


@LOOPS
async def test_a_scope_made_without_the_class_call_is_the_same_scope() -> None:
    """Holder scopes skip the class call (``new_scope``): anyio's back-end class must
    still have a Python ``__new__`` that sets nothing (``__init__`` sets every slot), so
    the scope made without it equals one made by calling the class, and works as one."""
    scope_type = type(anyio.CancelScope())
    assert "__new__" in vars(scope_type), "anyio's scope class lost its __new__: revisit"
    made, called = new_scope(scope_type), scope_type()
    assert type(made) is scope_type
    slots = [s for cls in scope_type.__mro__ for s in getattr(cls, "__slots__", ())]
    assert slots
    for slot in slots:
        mangled = f"_{scope_type.__name__}{slot}" if slot.startswith("__") else slot
        assert hasattr(made, mangled) == hasattr(called, mangled), slot
        if hasattr(called, mangled) and not slot.endswith("original"):
            assert getattr(made, mangled) == getattr(called, mangled), slot
    with made:
        made.cancel()
        await anyio.lowlevel.checkpoint()
    assert made.cancelled_caught


@LOOPS
async def test_checkpoint_if_cancelled_is_found_on_the_back_end_class() -> None:
    """anyio's per-back-end ``checkpoint_if_cancelled`` is found (not the fallback) and
    raises in a cancelled scope, as the public function does."""
    method = _checkpoint_if_cancelled_for(type(anyio.CancelScope()))
    assert method is not anyio.lowlevel.checkpoint_if_cancelled, "the shortcut fell back"
    with anyio.CancelScope() as scope:
        scope.cancel()
        await method()
        pytest.fail("checkpoint_if_cancelled did not raise in a cancelled scope")
    assert scope.cancelled_caught


@LOOPS
async def test_the_current_task_shortcut_names_the_running_task() -> None:
    current = _current_task_function(type(anyio.CancelScope()))
    assert current is not _any_current_task, "no shortcut for this event loop any more"
    seen: list[object] = []

    async def child() -> None:
        seen.append(current())

    async with anyio.create_task_group() as tg:
        tg.start_soon(child)
    mine = current()
    assert mine is not None and seen[0] is not None and seen[0] is not mine


async def test_the_asyncio_task_shortcut_reads_the_dict_asyncio_keeps() -> None:
    """Python 3.11: the running task is read from the dict asyncio's C tasks keep it in
    (no Python frame per call); later Pythons keep their C ``current_task``."""
    import asyncio
    import inspect

    current = _current_task_function(type(anyio.CancelScope()))
    assert current() is asyncio.current_task()
    if inspect.isfunction(asyncio.current_task):  # Python 3.11
        running = asyncio.tasks._current_tasks  # type: ignore[attr-defined]
        assert getattr(current, "func", None) == running.get, "the shortcut fell back"


def test_the_level_cache_is_the_one_logging_fills_and_empties() -> None:
    """``_level_cache`` hands out the dict ``Logger.isEnabledFor`` caches its answers in,
    which logging empties whenever a level changes: a False found there is the answer."""
    import logging

    from asynclock._core.fastpath import _level_cache

    logger = logging.getLogger("asynclock.test-level-cache")
    cache = _level_cache(logger)
    assert cache is getattr(logger, "_cache", None), "logging keeps no cache: revisit"
    old = logger.level
    try:
        logger.setLevel(logging.INFO)
        assert not logger.isEnabledFor(logging.DEBUG)
        assert cache.get(logging.DEBUG, True) is False
        logger.setLevel(logging.DEBUG)  # a level change empties the very same dict
        assert cache.get(logging.DEBUG, True) is True
        assert logger.isEnabledFor(logging.DEBUG)
        logging.disable(logging.DEBUG)  # and so does logging.disable
        try:
            assert cache.get(logging.DEBUG, True) is True
            assert not logger.isEnabledFor(logging.DEBUG)
        finally:
            logging.disable(logging.NOTSET)
        logger.disabled = True  # not in the cache: the shortcut asks isEnabledFor then
        try:
            assert not logger.isEnabledFor(logging.DEBUG)
        finally:
            logger.disabled = False
    finally:
        logger.setLevel(old)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
def test_the_scope_shortcut_is_checked_on_the_anyio_installed(anyio_backend: str) -> None:
    """``scope_maker`` uses ``object.__new__`` only for a class whose ``__new__`` makes the
    object and nothing else; any other anyio (no ``__new__``, or one that sets state)
    gets the class call: a user's newer anyio cannot break holds, only slow them."""
    from asynclock._core.fastpath import _new_object, scope_maker

    class Plain:
        __slots__ = ("a",)

        def __init__(self) -> None:
            self.a = 1

    class Bare(Plain):
        __slots__ = ()

        def __new__(cls) -> Bare:
            return object.__new__(cls)

    class Busy(Plain):
        __slots__ = ("b",)
        b: int

        def __new__(cls) -> Busy:
            made = object.__new__(cls)
            made.b = 2  # state __init__ does not set: the shortcut would lose it
            return made

    assert scope_maker(Bare) is _new_object  # type: ignore[arg-type]
    assert scope_maker(Plain) is not _new_object  # type: ignore[arg-type]
    assert scope_maker(Busy) is not _new_object  # type: ignore[arg-type]


@LOOPS
async def test_the_scope_shortcut_holds_on_this_anyio() -> None:
    from asynclock._core.fastpath import _new_object, scope_maker

    assert scope_maker(type(anyio.CancelScope())) is _new_object
