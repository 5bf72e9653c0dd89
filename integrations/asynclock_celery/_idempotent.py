"""Idempotent tasks: a run keyed by its arguments replays the stored result of the run that
completed before, instead of running the body again (``backend.idempotent``, see
docs/idempotency.md).

Why it has its own hand-over and does not reuse ``from_thread.Handover``: the lease of an
idempotent run is taken *inside* ``async with backend.idempotent(...)`` on the loop, and
the body's outcome has to go back into that ``async with`` (the fenced save of the
result, a stored failure, or the record freed for a retry) before the lease is released.
So the loop task stays in the ``async with`` while the body runs in the task's thread:

1. the body's thread posts :meth:`IdempotentRun.begin` and waits; the loop enters
   ``backend.idempotent(...)`` and answers with a replay, a lease, or an error
   (``InProgress`` when the key runs elsewhere and the task does not wait);
2. with a lease, the body runs in its thread under it (stopped with ``LeaseLost`` when the
   loop sees the lease lost, as for every locked task);
3. the body's thread posts :meth:`IdempotentRun.end` with the body's outcome and waits; the
   loop saves the result (fenced: a stale run's result is refused with ``StaleToken``) or
   raises the body's error inside the ``async with``, which stores it (``store_errors``) or
   frees the key, then releases.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
from celery import Task

import asynclock
from asynclock.from_thread import BodyGuard, stop_on_loss

#: How long a stored result is kept by default (the core's default: 24 h, Stripe's), and
#: the bounds the core allows (1 s to 30 days).
DEFAULT_KEEP, MIN_KEEP, MAX_KEEP = 86400.0, 1.0, 30 * 86400.0


@dataclass(frozen=True)
class Idempotency:
    """An idempotent task's options, checked when the task is declared."""

    #: The key's template; None: the task's name and a hash of all its arguments.
    key: asynclock.NameTemplate | None
    #: The argument names whose values must match for a replay; None: all of them.
    fingerprint: tuple[str, ...] | None
    keep: float
    store_errors: tuple[type[Exception], ...]

    def key_of(self, task_name: str, arguments: dict[str, Any]) -> str:
        if self.key is not None:
            return self.key.format(arguments)
        digest = hashlib.sha256(_canonical(arguments, "arguments").encode()).hexdigest()[:32]
        key = f"{task_name}:{digest}"
        if len(key.encode()) > 255:  # a very long task name: hash it too
            key = "task:" + hashlib.sha256(key.encode()).hexdigest()
        return key

    def fingerprint_of(self, arguments: dict[str, Any]) -> dict[str, Any] | None:
        if self.fingerprint is None:
            return arguments
        if not self.fingerprint:
            return None
        return {n: arguments.get(n) for n in self.fingerprint}


def _canonical(value: object, what: str) -> str:
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"an idempotent task's {what} must be JSON-serialisable to be hashed ({exc}); "
            "name the arguments that identify the request with idempotency_fingerprint "
            "(or fingerprint=) and give idempotency_key a template of them"
        ) from None


def check_idempotency(
    key: str | None,
    fingerprint: object,
    keep: object,
    store_errors: object,
    func: Callable[..., Any] | None,
    names: tuple[str, str, str, str],
) -> Idempotency:
    """The options as declared, checked (``names``: how the user spells the key, the
    fingerprint, keep and store_errors options)."""
    template = None if key is None else asynclock.NameTemplate(key)
    if fingerprint is not None:
        if isinstance(fingerprint, str) or not (
            isinstance(fingerprint, (tuple, list)) and all(isinstance(f, str) for f in fingerprint)
        ):
            raise TypeError(
                f"{names[1]} must be a tuple of argument names, e.g. ('amount', 'currency'), "
                f"or None (all arguments), got {fingerprint!r}"
            )
        fingerprint = tuple(fingerprint)
    f = asynclock.check_seconds(keep, names[2])
    if not (MIN_KEEP <= f <= MAX_KEEP):
        raise ValueError(
            f"{names[2]} must be between {MIN_KEEP:g} second and {MAX_KEEP:g} seconds "
            f"(30 days), got {keep!r}"
        )
    if isinstance(store_errors, type):
        store_errors = (store_errors,)
    if not isinstance(store_errors, tuple) or not all(
        isinstance(t, type) and issubclass(t, Exception) for t in store_errors
    ):
        raise TypeError(
            f"{names[3]} must be a tuple of Exception subclasses (the errors stored and "
            f"replayed instead of retried), got {store_errors!r}"
        )
    if func is not None:
        what = f"task {getattr(func, '__qualname__', func)!s}()"
        if template is not None:
            template.check_callable(func, what=what)
        params = inspect.signature(func).parameters
        missing = [n for n in fingerprint or () if n not in params]
        if missing and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            raise TypeError(f"{names[1]} names {', '.join(missing)}, which {what} does not take")
    return Idempotency(template, fingerprint, f, store_errors)


def arguments_of(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The call's arguments by name, defaults applied, ``**kwargs`` flattened, the task
    itself (``bind=True`` under ``@locked``) left out."""
    signature = inspect.signature(func)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    arguments: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            arguments[name] = list(value)
        elif not isinstance(value, Task):
            arguments[name] = value
    return arguments


class _Aborted(Exception):
    """A body that ended with a BaseException that is not an Exception (SystemExit, …):
    raised on the loop in its place (asyncio would stop the loop on the original), so
    the record is freed and the original is raised in the body's thread."""


class IdempotentRun:
    """One idempotent run: the loop task in ``async with backend.idempotent(...)`` and the
    body's thread, handing over with one lock (see the module's docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._ready = threading.Lock()
        self._ready.acquire()
        self._ended: asyncio.Event | None = None
        self._scope: anyio.CancelScope | None = None
        self._given_up = False
        self.call: asynclock.IdempotentCall | None = None
        self.error: BaseException | None = None
        #: Set by the body's thread before the body starts; interrupted on loss.
        self.guard: BodyGuard | None = None
        self._result: Any = None
        self._body_error: BaseException | None = None

    # -- the body's thread

    def begin(self, guard: asynclock.Idempotent) -> None:
        """Enter ``guard`` on the loop: :attr:`call` (replayed, or holding a lease), or
        :attr:`error`."""
        self._loop.call_soon_threadsafe(self._start, guard)
        try:
            self._ready.acquire()
        except BaseException:
            self._loop.call_soon_threadsafe(self._give_up)
            raise

    def end(self, result: Any, error: BaseException | None) -> None:
        """The body is over: store ``result`` (or settle ``error``) and release; when this
        returns, :attr:`error` says what went wrong (None: the result is stored)."""
        self._result, self._body_error = result, error
        self._loop.call_soon_threadsafe(self._end)
        self._ready.acquire()

    # -- the loop's side

    def _start(self, guard: asynclock.Idempotent) -> None:
        self._ended = asyncio.Event()
        self._loop.create_task(self._run(guard))

    def _end(self) -> None:
        assert self._ended is not None
        self._ended.set()

    def _give_up(self) -> None:
        self._given_up = True
        if self._scope is not None:
            self._scope.cancel()
        if self._ended is not None:
            self._ended.set()

    def _signal(self) -> None:
        if self._ready.locked():
            self._ready.release()

    async def _run(self, guard: asynclock.Idempotent) -> None:
        try:
            with anyio.CancelScope() as scope:  # cancelled if the body's thread gave up
                self._scope = scope
                if self._given_up:
                    scope.cancel()
                async with guard as call:
                    self.call = call
                    self._signal()  # the body may start (or return the stored result)
                    if call.replayed:
                        return
                    lease = call.lease
                    assert lease is not None
                    await self._watch(lease)
                    if self._given_up:
                        raise _Aborted("the task's thread gave up waiting for its lock")
                    error = self._body_error
                    if error is not None:
                        raise error if isinstance(error, Exception) else _Aborted(repr(error))
                    await call.save(self._result)
        except BaseException as exc:
            if not isinstance(exc, _Aborted):  # else the body's own error is raised
                self.error = exc
            if not isinstance(exc, Exception):
                raise
        finally:
            self._signal()

    async def _watch(self, lease: asynclock.Lease) -> None:
        """Until the body is over; a loss of ``lease`` meanwhile interrupts the body (the
        wait is shielded: the ``async with`` is left only after the body has ended)."""
        assert self._ended is not None
        ended = self._ended

        async def interrupt_on_loss() -> None:
            await lease.lost.wait()
            if self.guard is not None:  # else BodyGuard.enter() sees the loss
                await stop_on_loss(lease, self.guard)

        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tg:
                tg.start_soon(interrupt_on_loss)
                await ended.wait()
                tg.cancel_scope.cancel()
