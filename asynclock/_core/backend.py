"""Backend: one driver plus the core's timing, cancellation and the lease's lifecycle.

Shared by every backend (small backends, smart core): the lifecycle and the public API
here; acquisition and release (G3, G6) in ``acquisition.py``, the renewer and the
watchdog in ``renewer.py``, the ``Lock`` in ``lock.py``."""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, ParamSpec, Self, TypeVar, cast

import anyio
import anyio.abc
import anyio.lowlevel

from .acquisition import Holding
from .bounds import CallBounds
from .clock import Clock, MonotonicClock
from .context import HOLDS, ExcInfo
from .driver import Driver
from .exceptions import AsynclockError, BackendUnavailable
from .fastpath import (
    _any_current_task,
    _checkpoint_if_cancelled_for,
    _current_task_function,
    _describe_loop,
)
from .holder import Holder
from .leadership import Leader, Leadership, find_leader
from .lease import Lease
from .lock import Lock as Lock
from .lock import _check_lock_args, _check_scope, _refuse_nested, locked_function
from .misuse import AsyncContextOnly
from .renewer import _ExtendRequest, _Held
from .stats import BackendStats, StatsRecorder
from .validation import check_name, check_token, check_ttl

logger = logging.getLogger("asynclock")
_get_ident = threading.get_ident
T = TypeVar("T")
P = ParamSpec("P")


class Backend(Holding, AsyncContextOnly):
    """A lock service: hand out leases on names, renew them, and stop holders that lose them.

    Create one with :func:`asynclock.connect` (or pass a driver for tests) and use it as an
    async context manager; it owns the background renewer of every lease it grants.

    Args:
        driver: the backend driver (see ``asynclock.backends``).
        clock: monotonic clock used for deadlines (default ``time.monotonic``).
        drift: clock-rate allowance as a fraction of ttl (default 1 %).
        margin: seconds taken off every local deadline (default 5 ms).
        heartbeat: renew every ``ttl * heartbeat`` seconds (default 1/3).
        release_timeout: bound on a release or on the clean-up of an interrupted acquire.
    """

    _usage = "asynclock.connect(url)"

    def __init__(
        self,
        driver: Driver,
        *,
        clock: Clock | None = None,
        drift: float = 0.01,
        margin: float = 0.005,
        heartbeat: float = 1 / 3,
        release_timeout: float = 5.0,
    ) -> None:
        if not isinstance(driver, Driver):
            raise TypeError(f"driver must be an asynclock Driver, not {type(driver).__name__}")
        if not (0 <= drift < 0.5):
            raise ValueError(f"drift must be a fraction in [0, 0.5), got {drift!r}")
        if not (0 <= margin < math.inf):
            raise ValueError(f"margin must be a finite number of seconds >= 0, got {margin!r}")
        if not (0 < heartbeat < 1):
            raise ValueError(f"heartbeat must be a fraction of ttl in (0, 1), got {heartbeat!r}")
        check_ttl(release_timeout, what="release_timeout")
        self.driver = driver
        self.clock: Clock = clock or MonotonicClock()
        self.drift = drift
        self.margin = margin
        self.heartbeat = heartbeat
        # owner -> (weak reference to the Lease, name, token): a lease nobody references
        # any more is not renewed but released, with a warning (see _reap_dropped).
        self._held: dict[str, _Held] = {}
        self._dropped: list[weakref.ref[Lease]] = []  # appended by the weakref callback
        self._on_collected = self._dropped.append
        self._bounds = CallBounds(self.clock, release_timeout)
        self._owner_prefix = os.urandom(12).hex()
        self._owner_seq = itertools.count(1)
        self._stats = StatsRecorder()
        self._release_events: dict[str, anyio.Event] = {}
        self._renew_wake: anyio.CancelScope | None = None
        self._watch_wake: anyio.CancelScope | None = None
        self._next_round: float = math.inf
        self._renew_asap = False  # renew_now() asked for a round after the current one
        self._watch_until: float = -math.inf  # what the watchdog sleeps until, if it sleeps
        self._round_done = anyio.Event()
        #: ``lease.extend(ttl)`` requests for the renewer's next round, by owner.
        self._extends: dict[str, _ExtendRequest] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        self._scope_type: type[anyio.CancelScope] = anyio.CancelScope
        self._checkpoint_if_cancelled: Callable[[], Awaitable[None]] = (
            anyio.lowlevel.checkpoint_if_cancelled
        )
        self._open = False
        # Waiters' cancel scopes (cancelled when the backend closes) and the number of
        # acquisitions in flight (close waits for them to settle before it closes the driver).
        self._waiters: set[anyio.CancelScope] = set()
        self._pending = 0
        self._settled: anyio.Event | None = None
        # The thread whose event loop opened the backend: every acquire, validate and
        # release compares it with the running thread's id (~30 ns; asking for the running
        # loop itself costs ~10 times that on the hold fast path). Another loop in the
        # same thread (a later asyncio.run) is caught where the running task is looked up
        # anyway: asyncio's current task *of the opening loop* is None there.
        self._thread: int | None = None
        self._opened_in = "no event loop (not open)"
        self._current_task: Callable[[], object] = _any_current_task
        self._remote = bool(driver.remote)
        driver.bind(self.clock, self._wake_waiters, self._lost_out_of_band, self._renew_soon)

    def __repr__(self) -> str:
        return f"<asynclock.Backend {self.driver.display} held={len(self._live())}>"

    # -- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._open:
            raise RuntimeError("this backend is already open; use one `async with` per backend")
        # The running event loop's cancel scope class: holder scopes are made directly,
        # skipping anyio's per-call back-end lookup (a measurable part of a fast hold).
        self._scope_type = type(anyio.CancelScope())
        self._checkpoint_if_cancelled = _checkpoint_if_cancelled_for(self._scope_type)
        self._current_task = _current_task_function(self._scope_type)
        self._thread = _get_ident()
        self._opened_in = _describe_loop()
        await self.driver.open()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._open = True
        self._tg.start_soon(self.driver.background, name=f"asynclock {self.driver.display}")
        self._tg.start_soon(self._renew_loop, name="asynclock renewer")
        self._tg.start_soon(self._watchdog_loop, name="asynclock watchdog")
        self._tg.start_soon(self._bounds.run, name="asynclock release deadlines")
        return self

    async def __aexit__(self, *exc_info: *ExcInfo) -> bool | None:
        self._open = False
        # Waiters raise BackendUnavailable; a lease granted from now on is released by
        # the task that asked for it (see _acquire). Wait (bounded) for them to settle,
        # so their clean-up still has a driver to talk to.
        for scope in list(self._waiters):
            scope.cancel()
        if self._pending:
            self._settled = anyio.Event()
            with anyio.move_on_after(self.release_timeout, shield=True):
                await self._settled.wait()
        held = self._live()
        for lease in held:
            self._lose(lease, "backend closed")
        with anyio.CancelScope(shield=True):
            for lease in held:
                await self._release(lease, quiet=True)
            await self._reap_dropped()
        assert self._tg is not None
        self._tg.cancel_scope.cancel()
        # Hand the task group only a cancellation (it may be its own, from a crashed
        # background task); anything else the body raised propagates as it is, never
        # wrapped in an ExceptionGroup.
        cancelled = isinstance(exc_info[1], anyio.get_cancelled_exc_class())
        try:
            if cancelled:
                return await self._tg.__aexit__(*exc_info)
            await self._tg.__aexit__(None, None, None)
            return None
        finally:
            # Closed: nothing runs on the loop any more (and the loop is not kept alive).
            self._current_task = _any_current_task
            with anyio.CancelScope(shield=True):
                await self.driver.aclose()

    @property
    def release_timeout(self) -> float:
        """Bound (seconds) on a release or on the clean-up of an interrupted acquire."""
        return self._bounds.timeout

    def _require_open(self) -> None:
        if not self._open:
            raise RuntimeError(
                "backend is not open: use `async with asynclock.connect(url) as backend:`"
            )

    def _check_loop(self) -> None:
        """Raise unless called from a task of the event loop that opened the backend."""
        if _get_ident() != self._thread or self._current_task() is None:
            self._wrong_loop()

    def _wrong_loop(self) -> None:
        """Raise: this backend is used from an event loop other than the one it opened in."""
        raise RuntimeError(
            f"this {self.driver.display} backend belongs to the event loop it was opened in "
            f"({self._opened_in}) but was used from another one ({_describe_loop()}); open "
            "one backend per event loop (per thread)"
        )

    # -- public API ------------------------------------------------------------------------

    def lock(
        self,
        name: str,
        *,
        ttl: float,
        timeout: float | None = None,
        blocking: bool = True,
        max_hold: float | None = None,
        token_scope: str | None = None,
    ) -> Lock:
        """An async context manager that holds ``name`` for the body and yields the Lease.

        The body runs in a cancel scope that is cancelled when the lease is lost; the
        ``async with`` then raises :class:`LeaseLost`. Busy with ``blocking=False`` raises
        :class:`LockHeld`; not acquired within ``timeout`` raises :class:`AcquireTimeout`.
        Inside this task's own hold of ``name`` (a lock or a leadership term) it raises
        :class:`AlreadyHeld` at once: locks are not re-entrant.

        ``token_scope`` (a str validated like a name) draws the token from the scope's
        counter as well as the name's: every lease taken with one scope gets a token
        greater than every earlier token of that scope, whatever its name (G2 per scope),
        and still greater than every earlier token of the name. Use it when one logical
        job locks a new name per occurrence (``"nightly@2026-12-01T03:00"``) and its
        writes must be fenced in order.
        """
        return Lock(
            self,
            name,
            ttl=ttl,
            timeout=timeout,
            blocking=blocking,
            max_hold=max_hold,
            token_scope=token_scope,
        )

    async def acquire(
        self,
        name: str,
        *,
        ttl: float,
        timeout: float | None = None,
        blocking: bool = True,
        max_hold: float | None = None,
        token_scope: str | None = None,
    ) -> Lease:
        """Acquire without a context manager. You must ``await lease.release()``.

        No cancel scope guards your work here: watch ``lease.lost`` or call
        ``lease.check()`` before side effects, and fence your writes with ``lease.token``.
        ``token_scope``: as in :meth:`lock`. Inside this task's own ``async with`` hold of
        ``name`` it raises :class:`AlreadyHeld` at once, as :meth:`lock` does.
        """
        args = _check_lock_args(name, ttl, timeout, blocking, max_hold)
        task = self._current_task()
        if self._open and task is None:
            self._wrong_loop()
        scope = None if token_scope is None else _check_scope(token_scope)
        holds = HOLDS.get()
        if holds:  # inside this task's own `async with` for the name: it would wait for itself
            _refuse_nested(self, args[0], holds, task)
        return await self._acquire(*args, token_scope=scope)

    async def validate(self, name: str, token: int) -> bool:
        """True if ``token`` is the live holder's token for ``name`` right now (G9).

        False for a token that was a holder's but is not the live one (released, expired,
        lost, or an older holder's).

        Raises:
            TypeError: ``token`` is not an int.
            ValueError: ``token`` is an int that no lease can have: 0, negative, or not
                below ``2**63`` (tokens are positive 64-bit ints). Check a token that comes
                from outside (a request header, a message) before asking, as the fences do.
        """
        self._require_open()
        self._check_loop()
        check_name(name)
        check_token(token)
        return bool(await self._call("validate", self.driver.validate(name, token)))

    def stats(self) -> BackendStats:
        """A snapshot of counters and hold-time percentiles since the backend opened."""
        return self._stats.snapshot(held=len(self._live()))

    def held(self) -> list[Lease]:
        """The leases this backend currently holds (and renews)."""
        return self._live()

    def _live(self) -> list[Lease]:
        return [lease for ref, _, _ in list(self._held.values()) if (lease := ref()) is not None]

    async def _call(self, what: str, call: Awaitable[object], passing: Passing = ()) -> object:
        """``call``'s result; a library error as BackendUnavailable (not ``passing`` ones)."""
        try:
            return await call
        except AsynclockError:
            raise
        except Exception as exc:
            if isinstance(exc, passing):
                raise
            raise BackendUnavailable(f"{self.driver.display}: {what} failed: {exc!r}") from exc

    # -- who holds it, changing a ttl, breaking a lock, decorating a function --------------

    async def holder(self, name: str) -> Holder | None:
        """Who holds ``name`` right now, as the server sees it, or ``None`` if nobody does.

        A snapshot (the lease may end the moment after): for dashboards and operators, not
        for deciding who may write (fence writes with your lease's token). Fields a backend
        cannot know are ``None``; see :class:`~asynclock.Holder`.
        """
        self._require_open()
        self._check_loop()
        check_name(name)
        found = await self._call("holder", self.driver.holder(name), (NotImplementedError,))
        return cast("Holder | None", found)

    async def locked(self, name: str) -> bool:
        """True if some lease holds ``name`` right now (a snapshot, as :meth:`holder`)."""
        return await self.holder(name) is not None

    async def break_lock(self, name: str) -> bool:
        """Remove whoever holds ``name`` (for operators); True if a live lease was removed.

        Logged at WARNING. The broken holder, in any process, loses its lease at its next
        renewal at the latest (its ``async with`` raises :class:`LeaseLost`), and its token
        stays fenced off: the next acquisition's token is larger. Unlike a release this is
        not owner-checked, so it can end a healthy holder's lease: use it for a holder
        that is stuck, not to take a lock. PostgreSQL ``mode=session`` ends the holder's
        database session, and with it every lock that session holds.
        """
        self._require_open()
        self._check_loop()
        check_name(name)
        logger.warning("break_lock(%r) on %s: removing whoever holds it", name, self.driver.display)
        call = self.driver.break_lock(name)
        broken = bool(await self._call("break_lock", call, (NotImplementedError,)))
        if broken:
            logger.warning("break_lock(%r): a live lease was removed", name)
            # A holder on this very backend need not wait for its next renewal.
            for lease in [lease for lease in self._live() if lease.name == name]:
                self._lose(lease, "lock broken by break_lock()")
        return broken

    def locked_function(
        self,
        name: str,
        /,
        *,
        ttl: float,
        timeout: float | None = None,
        blocking: bool = True,
        max_hold: float | None = None,
    ) -> Callable[[Callable[P, Awaitable[T]]], Callable[P, Coroutine[Any, Any, T]]]:
        """Decorate an ``async def`` function so every call runs holding a lock.

        ``name`` is a :class:`~asynclock.NameTemplate` formatted from the call's arguments
        (``"invoice:{invoice_id}"``); the other arguments are those of :meth:`lock`. Inside
        the call :func:`asynclock.current_lease` is the lease, and a lost lease cancels the
        call, which raises :class:`LeaseLost`.

        Raises:
            TypeError: at decoration, if the function is not an ``async def`` function or
                the template names an argument it does not take.
            ValueError: at decoration, for a malformed template or bad lock arguments.
        """
        return locked_function(self, name, (ttl, timeout, blocking, max_hold))

    def leadership(self, name: str, *, ttl: float, identity: str | None = None) -> Leadership:
        """Campaign for leadership of ``name``; ``identity`` (default ``host:pid``) is what
        :meth:`leader` tells other processes.

        ``async with backend.leadership(name, ttl=...) as term:`` waits until elected and
        yields a :class:`Term`; the body is cancelled when the term is lost and the block
        raises :class:`LeaseLost`. ``async for term in backend.leadership(...):`` with
        ``async with term:`` inside campaigns again after each loss (with backoff) until
        the loop is left; after ``async with term:``, ``term.lease.lost.reason`` says
        whether (and why) that term was lost.

        ``ttl`` is checked here, as :meth:`lock` checks it (at most :data:`asynclock.MAX_TTL`).
        Campaigning inside this task's own hold of ``name`` raises :class:`AlreadyHeld`.
        """
        return Leadership(self, name, ttl, identity)

    async def leader(self, name: str) -> Leader | None:
        """Who leads ``name`` now (its identity and token), or None if nobody holds it.

        Raises NotImplementedError on backends whose server keeps no owner for a lock
        (postgres ``mode=session``, redlock).
        """
        self._require_open()
        return await find_leader(self.driver, check_name(name))


#: Errors :meth:`Backend._call` lets through as they are.
Passing = tuple[type[Exception], ...]
