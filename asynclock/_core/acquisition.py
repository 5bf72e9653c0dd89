"""Acquisition: one hold's path through the core, over (driver, session, clock).

* acquisition reads ``t_send`` before it asks and hands the granted lease to the session,
  whose one deadline function sets the local deadline (G3);
* an interrupted acquire releases whatever the server may have granted, shielded and
  bounded; release on exit is shielded and bounded; local state changes only after the
  server confirms (G6);
* a waiter sleeps until a release wakes it, its retry time, or its timeout (no busy poll).

:class:`Acquisition` is what ``Lock``, ``Lease`` and ``Leadership`` hold on to (their
protocol: its names without a leading underscore)."""

from __future__ import annotations

import itertools
import logging
import os
import random
import threading
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

import anyio
import anyio.lowlevel

from .bounds import CallBounds, cleanup
from .busy import busy_error as _busy_error
from .busy import timeout_detail as _timeout_detail
from .clock import Clock
from .context import LEASES, Entry, enter_body, refuse_nested
from .driver import Busy, Driver
from .exceptions import (
    AcquireTimeout,
    AsynclockError,
    BackendUnavailable,
    LeaseLost,
)
from .fastpath import (
    _any_current_task,
    _called,
    _checkpoint_if_cancelled_for,
    _current_task_function,
    _describe_loop,
    _level_cache,
    scope_maker,
)
from .keeper import SENT_AT, Grants
from .lease import Lease
from .owner_label import label_tag
from .release import Releasing
from .session import Session
from .stats import StatsRecorder
from .threads import ThreadGrants
from .validation import check_lock_args, check_scope
from .wakes import woken_name

logger = logging.getLogger("asynclock")
#: ``logger.isEnabledFor``'s answer for a level, if known (see fastpath._level_cache).
_known_level = _level_cache(logger).get
_DEBUG = logging.DEBUG
_get_ident = threading.get_ident

#: How long a waiter sleeps between attempts when the driver gives no hint.
DEFAULT_POLL = 0.05


class Acquisition(Releasing, ThreadGrants):
    """Acquire, wait, grant and release the leases of one backend (one event loop)."""

    def __init__(
        self, driver: Driver, session: Session, clock: Clock, bounds: CallBounds, label: str
    ) -> None:
        self.driver = driver
        self.session = session
        self.clock = clock
        self.bounds = bounds
        self.stats: StatsRecorder = session.stats
        # Owners: 96 random bits per backend above a counter, as 32 hex digits (unique per
        # acquisition; one int formatted per acquisition, no syscall for fresh randomness).
        self._owner_seq = itertools.count((int.from_bytes(os.urandom(12), "big") << 32) + 1)
        #: This process's owner label (``connect(owner_label=...)``), and the tag after the
        #: owner id that carries it to the server in every owner string (see owner_label).
        self.label = label
        self.label_tag = label_tag(label)
        #: Each waiter's wake-up: name -> owner -> the event a release of the name (or a
        #: hand-off to that owner) sets (see :meth:`wake`).
        self._release_events: dict[str, dict[str, anyio.Event]] = {}
        #: The running loop's cancel scope class (holder scopes are made directly,
        #: skipping anyio's per-call back-end lookup: a measurable part of a fast hold).
        self.scope_type: type[anyio.CancelScope] = anyio.CancelScope
        self._new_scope: Callable[[type[Any]], Any] = _called  # until bind_loop
        self._checkpoint_if_cancelled: Callable[[], Awaitable[None]] = (
            anyio.lowlevel.checkpoint_if_cancelled
        )
        #: True between the backend's open and the start of its close.
        self.open = False
        # Waiters' cancel scopes (cancelled on close) and the acquisitions in flight (close
        # waits for them to settle before it closes the driver).
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
        #: The running task of the loop that opened the backend (None on another loop).
        self.current_task: Callable[[], object] = _any_current_task
        self._remote = bool(driver.remote)
        self._queues_locally = bool(driver.queues_locally)  # (3.11 caches no class lookup)
        session.wake, session.waiting = self.wake, self._release_events
        #: Clean-up tasks of calls made from other threads (see thread_acquire).
        self._spawned: set[Any] = set()

    # -- the event loop it belongs to ------------------------------------------------------

    def bind_loop(self) -> None:
        """Called by the backend as it opens, in the running event loop."""
        self.scope_type = scope_type = type(anyio.CancelScope())
        self._new_scope = scope_maker(scope_type)
        self._checkpoint_if_cancelled = _checkpoint_if_cancelled_for(scope_type)
        self.current_task = _current_task_function(scope_type)
        self._thread = _get_ident()
        self._opened_in = _describe_loop()

    def unbind_loop(self) -> None:
        """Closed: nothing runs on the loop any more (and the loop is not kept alive)."""
        self.current_task = _any_current_task

    def new_owner(self) -> str:
        """A fresh owner id (as each acquisition's)."""
        return "%032x" % next(self._owner_seq)  # noqa: UP031 (see acquire)

    def require_open(self) -> None:
        if not self.open:
            raise RuntimeError(
                "backend is not open: use `async with asynclock.connect(url) as backend:`"
            )

    def ready(self) -> Acquisition:
        """Itself, once checked: open, and called on the event loop that opened it."""
        self.require_open()
        self.check_loop()
        return self

    def check_loop(self) -> None:
        """Raise unless called from a task of the event loop that opened the backend."""
        if _get_ident() != self._thread or self.current_task() is None:
            self.wrong_loop()

    def wrong_loop(self) -> NoReturn:
        """Raise: this backend is used from an event loop other than the one it opened in."""
        raise RuntimeError(
            f"this {self.driver.display} backend belongs to the event loop it was opened in "
            f"({self._opened_in}) but was used from another one ({_describe_loop()}); open "
            "one backend per event loop (per thread)"
        )

    async def call(self, what: str, call: Awaitable[object], passing: Passing = ()) -> object:
        """``call``'s result; a library error as BackendUnavailable (not ``passing`` ones)."""
        try:
            return await call
        except AsynclockError:
            raise
        except Exception as exc:
            if isinstance(exc, passing):
                raise
            raise BackendUnavailable(f"{self.driver.display}: {what} failed: {exc!r}") from exc

    async def close(self) -> None:
        """The backend closes: waiters raise BackendUnavailable; a lease granted from now on
        is released by its asker. Waits (bounded) for them to settle (their clean-up needs
        the driver); then every held lease is lost (holder cancelled) and released."""
        self.open = False
        self.session.run_inbox()  # leases other threads were granted are held here too
        for scope in list(self._waiters):
            scope.cancel()
        if self._pending:
            self._settled = anyio.Event()
            with anyio.move_on_after(self.bounds.timeout, shield=True):
                await self._settled.wait()
        session = self.session
        held = session.live()
        for lease in held:
            session.lose(lease, "backend closed")
        with anyio.CancelScope(shield=True):
            for lease in held:
                await self.release(lease, quiet=True)
            await session.reap_dropped()

    # -- acquisition -----------------------------------------------------------------------

    async def acquire_checked(
        self,
        name: object,
        ttl: object,
        timeout: object,
        blocking: object,
        max_hold: object,
        token_scope: object,
    ) -> Lease:
        """``backend.acquire()``: its arguments checked, then :meth:`acquire`."""
        args = check_lock_args(name, ttl, timeout, blocking, max_hold)
        task = self.current_task()
        if self.open and task is None:
            self.wrong_loop()
        scope = None if token_scope is None else check_scope(token_scope)
        stack = LEASES.get()
        if stack:  # inside this task's own `async with` for the name: it would wait for itself
            refuse_nested(self, args[0], stack, task)
        return await self.acquire(*args, token_scope=scope)

    async def acquire(
        self,
        name: str,
        ttl: float,
        timeout: float | None,
        blocking: bool,
        max_hold: float | None,
        owner_tag: str = "",
        token_scope: str | None = None,
        template: str | None = None,
        holder: Holder | None = None,
        observed: bool = False,
        via: Grants | None = None,
    ) -> Lease:
        """The lease for ``name``, granted (arguments already checked).

        ``template``: the lock's name template, for the observers (``observed``: they were
        told already). ``holder``: ``Lock.__aenter__``'s lock, running task and this
        context's lease stack; the granted lease's body then begins here
        (``context.enter_body``), or LeaseLost is raised (after the release) if the lease is
        lost or past its deadline first. ``Lock.__aenter__`` returns this coroutine instead
        of awaiting it in one of its own: a coroutine layer less per hold. ``via``: the
        server side of another kind of hold acquired and waited for as a lock is (a
        semaphore's permits: ``Holds.acquire``); None: the driver's locks.
        """
        session = self.session
        if session.observer is not None and not observed:
            return await self._observed_acquire(
                name, ttl, timeout, blocking, max_hold, owner_tag, token_scope, template, holder,
                via,
            )  # fmt: skip
        grants: Grants = self.driver if via is None else via
        queues_locally = self._queues_locally if via is None else via.queues_locally
        if not self.open:
            self.require_open()
        if _get_ident() != self._thread:
            self.wrong_loop()
        if not self._remote:  # else the attempt's own suspension is the checkpoint
            await self._checkpoint_if_cancelled()
        if ttl <= session.min_ttl:
            raise session.ttl_error(ttl)
        # Unique per acquisition (see __init__; %-formatting one int is the cheapest way),
        # then this process's label (concatenated: cheaper than a two-field format).
        owner = "%032x" % next(self._owner_seq) + self.label_tag  # noqa: UP031
        if owner_tag:
            owner += owner_tag
        self._pending += 1
        try:
            # The first attempt, inline (the loop in _wait repeats it): most acquisitions
            # succeed here, and a call less is measurable on the fast path.
            t_send = self.clock.now()
            try:
                if token_scope is None:
                    result = await grants.acquire(name, owner, ttl, queue=blocking)
                else:
                    result = await grants.acquire(
                        name, owner, ttl, queue=blocking, scope=token_scope
                    )
            except BaseException as exc:
                await self._undo_acquire(name, owner, exc, grants)
                raise  # _undo_acquire raised the wrapped error for plain exceptions
            if queues_locally:  # measured from when the request went out
                t_send = max(t_send, SENT_AT.get())
            if isinstance(result, Busy):
                lease = await self._wait(
                    name, owner, ttl, t_send, timeout, blocking, max_hold, result, token_scope,
                    grants,
                )  # fmt: skip
            elif self.open:
                lease = session.grant(name, owner, result, ttl, t_send, max_hold, self, grants)
            else:
                await self._refuse_grant(name, owner, result, grants)
        except BaseException:
            if blocking:  # leave the wait queue (after any clean-up of the attempt)
                await cleanup(grants.abandon(name, owner), self.bounds, "abandon wait")
            raise
        finally:
            self._pending -= 1
            if self._settled is not None and not self._pending:
                self._settled.set()
        if holder is not None:
            scope = self._new_scope(self.scope_type)  # fastpath.new_scope(), inline
            scope.__init__()
            try:
                enter_body(holder[0], lease, holder[1], scope, holder[2])
            except LeaseLost:
                # Lost (or past its deadline: a frozen process) before the body began: the
                # body never runs; the release loses it if it was not, and gives it back.
                await self.release(lease, quiet=True)
                raise
        return lease

    async def _observed_acquire(
        self,
        name: str,
        ttl: float,
        timeout: float | None,
        blocking: bool,
        max_hold: float | None,
        owner_tag: str,
        token_scope: str | None,
        template: str | None,
        holder: Holder | None,
        via: Grants | None,
    ) -> Lease:
        """:meth:`acquire` told to the observers (the session has some)."""
        observer = self.session.observer
        assert observer is not None
        state = observer.acquire_started(name, template)
        now = self.clock.now
        started = now()
        try:
            lease = await self.acquire(
                name, ttl, timeout, blocking, max_hold, owner_tag, token_scope, None, holder, True,
                via,
            )  # fmt: skip
        except BaseException as exc:
            observer.acquire_finished(state, None, now() - started, exc)
            raise
        observer.acquire_finished(state, lease, now() - started, None)
        return lease

    async def _refuse_grant(self, name: str, owner: str, token: int, grants: Grants) -> NoReturn:
        """Granted after close began: nobody would renew it, so give it back and raise."""
        await cleanup(grants.release(name, owner, token), self.bounds, "release after close")
        raise BackendUnavailable(
            f"{self.driver.display}: backend closed while acquiring {name!r}; "
            "the lease it granted meanwhile was released"
        )

    async def _undo_acquire(
        self, name: str, owner: str, exc: BaseException, grants: Grants
    ) -> None:
        """An attempt was interrupted or failed: the server may have granted it (G6)."""
        driver = grants
        await cleanup(driver.release(name, owner, None), self.bounds, "clean up acquire")
        if isinstance(exc, Exception) and not isinstance(exc, AsynclockError):
            raise BackendUnavailable(
                f"{driver.display}: acquire of {name!r} failed: {exc!r}"
            ) from exc

    async def _wait(
        self,
        name: str,
        owner: str,
        ttl: float,
        started: float,
        timeout: float | None,
        blocking: bool,
        max_hold: float | None,
        result: Busy,
        token_scope: str | None,
        grants: Grants,
    ) -> Lease:
        """After a failed first attempt: wait for a release and try again (or give up)."""
        driver, clock = grants, self.clock
        give_up_at = None if timeout is None else started + timeout
        watching, watched = False, result.cursor
        released: anyio.Event | None = None  # this backend's wake-up for ``name``
        # Cancelled when the backend closes: a waiter must not outlive its backend (nobody
        # would renew what it got).
        closing = self.scope_type()
        self._waiters.add(closing)
        try:
            with closing:
                while True:
                    self.stats.busy_attempts += 1
                    if not blocking:
                        raise _busy_error(name, result)
                    now = clock.now()
                    if give_up_at is not None and now >= give_up_at:
                        assert timeout is not None
                        raise AcquireTimeout(name, timeout, _timeout_detail(name, result))
                    # Woken while the attempt was on its way (listening began before it):
                    # its busy answer may predate the release, so try again at once. The
                    # first attempt's misses are the driver's to report (watch below).
                    if released is None:  # the first busy answer: listen from now on
                        released, retry_now = self._listen(name, owner), False
                    else:
                        retry_now = released.is_set()  # then the one below is fresh
                    if not watching or result.cursor != watched:
                        # The first busy attempt, or one whose cursor moved (etcd: a new
                        # predecessor). The driver says whether a release may have been missed.
                        watching, watched = True, result.cursor
                        missed = await self.call("watch", driver.watch(name, watched))
                        retry_now = retry_now or bool(missed)
                    if not retry_now:
                        delay = DEFAULT_POLL if result.retry_after is None else result.retry_after
                        delay = delay * (1 + 0.1 * random.random()) + 0.0005 * random.random()
                        if give_up_at is not None:
                            delay = min(delay, give_up_at - now)
                        with anyio.move_on_after(max(0.0, delay)):
                            await released.wait()
                    released = self._listen(name, owner)  # a fresh one if that one was set
                    t_send = clock.now()
                    try:
                        attempt = await driver.acquire(
                            name, owner, ttl, queue=blocking, scope=token_scope
                        )
                    except BaseException as exc:
                        await self._undo_acquire(name, owner, exc, driver)
                        raise
                    if driver.queues_locally:
                        t_send = max(t_send, SENT_AT.get())
                    if not isinstance(attempt, Busy):
                        if self.open:
                            return self.session.grant(
                                name, owner, attempt, ttl, t_send, max_hold, self, driver
                            )
                        await self._refuse_grant(name, owner, attempt, driver)
                    result = attempt
            raise BackendUnavailable(
                f"{driver.display}: backend closed while waiting for lock {name!r}"
            )
        finally:
            self._waiters.discard(closing)
            self._unlisten(name, owner)
            if watching:
                await cleanup(driver.unwatch(name), self.bounds, "unwatch")

    def _listen(self, name: str, owner: str) -> anyio.Event:
        """The event the next release (or hand-off to ``owner``) of ``name`` sets (one per
        waiter, fresh once set: :meth:`wake`)."""
        events = self._release_events.get(name)
        if events is None:
            events = self._release_events[name] = {}
        released = events.get(owner)
        if released is None or released.is_set():
            released = events[owner] = anyio.Event()
        return released

    def _unlisten(self, name: str, owner: str) -> None:
        events = self._release_events.get(name)
        if events is not None:
            events.pop(owner, None)
            if not events:
                del self._release_events[name]

    # -- what a lease's own methods go through (lease.Grantor) ------------------------------

    async def let_expire(self, lease: Lease) -> bool:
        return await self.session.let_expire(lease)

    async def extend(self, lease: Lease, ttl: object) -> None:
        await self.session.extend(lease, ttl)

    def lose(self, lease: Lease, reason: str) -> None:
        self.session.lose(lease, reason)

    def wake(self, name: str, owner: str | None = None) -> None:
        """Wake this backend's waiters for ``name``: a release was seen (all may try), or,
        with ``owner``, the name was handed to that waiter (only it wakes: one wake-up per
        hand-off, not one per waiter). A ``wakes.wake_name``: its lease's."""
        name = woken_name(name) if name[:1] == "\x00" else name
        events = self._release_events.get(name)
        if not events:
            return
        if owner is None:
            for event in events.values():
                event.set()
            return
        one = events.get(owner)
        if one is not None:
            one.set()


#: What ``Lock.__aenter__`` hands :meth:`Acquisition.acquire`: the lock, the running task
#: and this context's lease stack.
Holder = tuple[object, object, tuple[Entry, ...]]

#: Errors :meth:`Acquisition.call` lets through as they are.
Passing = tuple[type[Exception], ...]
