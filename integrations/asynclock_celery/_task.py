"""``LockedTask`` and ``@locked``: hold a lease for a task's execution."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import os
import random
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, ClassVar, NoReturn, TypeVar, cast

import anyio
from celery import Celery, Task, current_app
from celery._state import get_current_task
from celery.exceptions import Reject, Retry

import asynclock

from ._interrupt import RESEND, Guard
from ._runtime import backend_url, get_runtime

logger = logging.getLogger("asynclock.celery")
F = TypeVar("F", bound=Callable[..., Any])

#: What a run does when the lock is held by someone else (the first is the default).
ON_BUSY = ("wait", "retry", "skip", "fail")
#: ``on_busy="retry"``: the first countdown is up to this many seconds; it doubles with
#: each retry (``self.request.retries``), with jitter, up to ``RETRY_BACKOFF_MAX``.
RETRY_BACKOFF = 1.0
RETRY_BACKOFF_MAX = 60.0
#: A lease's ttl must leave time after the backend's drift and margin (the defaults of
#: ``asynclock.connect``), as the core checks at acquire.
_DRIFT = 0.01
_MARGIN = 0.005


def _number(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number of seconds, not {type(value).__name__}")
    f = float(value)
    if math.isnan(f):
        raise ValueError(f"{what} must be a number of seconds, not NaN")
    return f


def _check_ttl(ttl: object, what: str) -> float:
    """A lease ttl, checked where it is declared by the rules the core applies at acquire
    (asynclock's own check is private: these are its rules and messages, with ``what``)."""
    f = _number(ttl, what)
    if not 0 < f < math.inf:
        raise ValueError(f"{what} must be a finite number of seconds > 0, got {ttl!r}")
    if f > asynclock.MAX_TTL:
        raise ValueError(
            f"{what} must be at most {asynclock.MAX_TTL:g} seconds (7 days), got {ttl!r}; the "
            "lease is renewed every ttl/3 while held, so hold as long as you like with a "
            "short ttl"
        )
    if f * (1 - _DRIFT) - _MARGIN <= 0:
        raise ValueError(
            f"{what}={f:g}s leaves no time after drift ({_DRIFT:.0%}) and margin "
            f"({_MARGIN:g}s); use a ttl of at least {2 * _MARGIN + 0.001:g}s"
        )
    return f


def _check_on_busy(on_busy: object) -> str:
    if not isinstance(on_busy, str) or on_busy not in ON_BUSY:
        raise ValueError(f"on_busy must be one of {', '.join(map(repr, ON_BUSY))}, got {on_busy!r}")
    return on_busy


def _check_timeout(timeout: object, on_busy: str, what: str) -> float | None:
    if timeout is None:
        return None
    f = _number(timeout, what)
    if not 0 <= f < math.inf:
        raise ValueError(
            f"{what} must be None (wait as long as it takes) or a finite number of "
            f"seconds >= 0, got {timeout!r}"
        )
    if on_busy != "wait":
        raise ValueError(
            f"{what} bounds the wait of on_busy='wait'; with on_busy={on_busy!r} nothing "
            f"waits: leave {what} unset or use on_busy='wait'"
        )
    return f


def _check_backoff(backoff: object, backoff_max: object, what: str) -> tuple[float, float]:
    first = _number(backoff, what)
    cap = _number(backoff_max, f"{what}_max")
    for value, name in ((first, what), (cap, f"{what}_max")):
        if not 0 < value < math.inf:
            raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
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


# -- async bodies: one asyncio.Runner per process and thread ------------------------------

_runners: dict[tuple[int, int], asyncio.Runner] = {}


def _runner() -> asyncio.Runner:
    """This thread's runner: module-level async clients keep working across tasks (a loop
    per task would break them). Made lazily, so a prefork child makes its own."""
    key = (os.getpid(), threading.get_ident())
    runner = _runners.get(key)
    if runner is None:
        for stale in [k for k in _runners if k[0] != key[0]]:
            del _runners[stale]  # inherited over fork: never used, never closed here
        runner = _runners[key] = asyncio.Runner()
    return runner


# -- the guarded run ----------------------------------------------------------------------


class _Hold:
    """One run's lease: taken, watched and given back by one task on the runtime's loop.

    The worker thread and the loop hand over with one lock, each step one wake-up: the
    worker posts ``begin`` (acquire) and waits; the loop signals the grant (or the error)
    and watches the lease; the worker posts ``end`` when the body is over and waits; the
    loop releases (owner-checked) and signals. This replaced a submitted coroutine and a
    future per step plus a watcher task, and cut the CPU a lock adds to a run by about a
    fifth (measured: ~0.42 -> ~0.35 ms per run, eager runs against a local Redis).
    """

    __slots__ = ("_finished", "_loop", "_ready", "_scope", "_task", "error", "guard", "lease")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        #: Held by the worker; the loop releases it at the grant and again at the end.
        self._ready = threading.Lock()
        self._ready.acquire()
        self._finished = False
        self._scope: anyio.CancelScope | None = None
        self._task: asyncio.Task[None] | None = None
        self.lease: asynclock.Lease | None = None
        self.error: BaseException | None = None
        #: Set by the worker before the body starts; interrupted on loss.
        self.guard: Guard | None = None

    # -- the worker's side

    def begin(self, backend: asynclock.Backend, name: str, policy: Policy) -> None:
        """Post the acquisition and wait for its outcome (``lease`` or ``error``)."""
        self._loop.call_soon_threadsafe(self._start, backend, name, policy)
        try:
            self._ready.acquire()
        except BaseException:
            # Interrupted while waiting (a soft time limit, a shutdown): stop waiting for the
            # lock; if it is granted after all, give it back instead of renewing it for the
            # process's life.
            self._loop.call_soon_threadsafe(self._finish)
            raise

    def end(self) -> None:
        """The body is over: post the release and wait until it is done."""
        self._loop.call_soon_threadsafe(self._finish)
        self._ready.acquire()

    # -- the loop's side

    def _start(self, backend: asynclock.Backend, name: str, policy: Policy) -> None:
        self._task = self._loop.create_task(self._run(backend, name, policy))

    def _finish(self) -> None:
        self._finished = True
        if self._scope is not None:
            self._scope.cancel()

    def _signal(self) -> None:
        if self._ready.locked():  # unlocked if the worker gave up waiting (begin raised)
            self._ready.release()

    async def _run(self, backend: asynclock.Backend, name: str, policy: Policy) -> None:
        lease: asynclock.Lease | None = None
        wait = policy.on_busy == "wait"
        try:
            with anyio.CancelScope() as scope:  # cancelled by _finish: the worker gave up
                self._scope = scope
                if self._finished:
                    scope.cancel()
                lease = await backend.acquire(
                    name, ttl=policy.ttl, blocking=wait, timeout=policy.timeout
                )
        except BaseException as exc:
            self.error = exc
            self._signal()
            if not isinstance(exc, Exception):
                raise
            return
        if lease is None:  # cancelled while waiting: nobody is there to be told
            return
        self.lease = lease
        try:
            with anyio.CancelScope() as scope:  # cancelled by _finish
                self._scope = scope
                if self._finished:
                    scope.cancel()
                self._signal()  # the body may start
                await lease.lost.wait()
                guard = self.guard
                if guard is not None:  # else the body has not started: enter() checks
                    guard.interrupt()
                    while guard.undelivered():
                        await anyio.sleep(RESEND)
                        guard.interrupt()
                await anyio.sleep_forever()  # until the body is over
        finally:
            try:
                await lease.release()  # a no-op that says so if the lease was lost
            except Exception as exc:
                logger.warning("release of %r failed (it expires by its ttl): %r", name, exc)
            finally:
                self._signal()


def run_guarded(
    task: Any,
    body: Callable[[], Any],
    *,
    name: str,
    policy: Policy,
    is_async: bool,
) -> Any:
    """Run ``body`` holding ``name``; see :class:`LockedTask` for the contract."""
    app: Celery = task.app if task is not None else current_app
    runtime = get_runtime()
    # A run a worker took from the queue can be sent again later; an eager or direct call
    # cannot (Celery's eager retry runs again at once, whatever the countdown).
    queued = task is not None and not task.request.is_eager and not task.request.called_directly
    while True:
        hold = _Hold(runtime.loop)
        try:
            backend = runtime.backend(backend_url(app))
            hold.begin(backend, name, policy)
        except asynclock.BackendUnavailable as exc:
            hold.error = exc
        if hold.error is None:
            break
        again = _not_acquired(task, name, hold.error, policy, queued)
        if again is None:
            return None  # skipped
        time.sleep(again)  # an eager or direct run in a restart grace: wait it out here
    _state.unavailable = False
    lease = hold.lease
    assert lease is not None
    try:
        if task is not None:
            task.request.asynclock_lease = lease
            task.request.fencing_token = lease.token
        if is_async:
            result, error = _run_async(body, lease, hold)
        else:
            result, error = _run_sync(body, lease, hold)
    finally:
        hold.end()
    if error is not None:
        raise error
    return result


class _State:
    """What this process has already logged (one line per grace, one per outage)."""

    grace_until: float = 0.0
    unavailable: bool = False


_state = _State()


def _not_acquired(
    task: Any, name: str, error: BaseException, policy: Policy, queued: bool
) -> float | None:
    """A run did not get its lock: raise (fail, retry later), return None (skip: the run
    ends SUCCESS with result None) or the seconds to wait in this process before it tries
    again (only a restart grace, which has a known end and is nobody's fault)."""
    if isinstance(error, asynclock.RestartGrace):
        # Nobody holds the name: the server lost its data and grants nothing until the
        # grace ends. Never a failure, never a skip (the run would be lost), and the retry
        # does not count against max_retries, which is for contention.
        left = error.retry_after or 0.0
        _log_grace(name, error.until, left, queued)
        if queued:
            _defer(task, error, countdown=round(left + random.uniform(0, 1), 3))
        return max(left, 0.001)
    if isinstance(error, asynclock.AcquireTimeout) and error.detail is not None:
        # lock_timeout ran out in a restart grace (AcquireTimeout.detail names it): the
        # grace is not contention; wait again.
        logger.info("lock %r: %s; waiting on", name, error.detail)
        return 0.0
    if isinstance(error, asynclock.BackendUnavailable) and queued:
        # The lock server is unreachable and nothing ran: retry with backoff (counted
        # against max_retries, so a server that stays down fails the run loudly).
        countdown = policy.countdown(task.request.retries)
        if not _state.unavailable:
            _state.unavailable = True
            logger.warning(
                "lock server unavailable; %s[%s] and other locked runs are retried with "
                "backoff (counted against max_retries): %s",
                task.name,
                task.request.id,
                error,
            )
        raise task.retry(exc=error, countdown=countdown)
    if task is None or not isinstance(error, asynclock.LockHeld):
        raise error
    if policy.on_busy == "skip":
        # Dropped: the run ends SUCCESS with result None (Ignore would leave the result
        # PENDING for good, so `.get()` would hang).
        logger.info("skipped %s[%s]: %s", task.name, task.request.id, error)
        return None
    if policy.on_busy == "retry":
        retries = task.request.retries
        if queued and task.max_retries is not None and retries >= task.max_retries:
            logger.warning(
                "%s[%s]: lock %r still held after %d retries (max_retries): the run fails "
                "with LockHeld",
                task.name,
                task.request.id,
                name,
                retries,
            )
        raise task.retry(exc=error, countdown=policy.countdown(retries))
    raise error  # "fail", or "wait" with blocking acquire refused (never: it waits)


def _log_grace(name: str, until: float, retry_after: float, queued: bool) -> None:
    then = "retried then (not counted against max_retries)" if queued else "waiting it out"
    if abs(until - _state.grace_until) > 1.0:
        _state.grace_until = until
        logger.info(  # the backend has said it at WARNING, once per grace
            "the lock server is in its restart grace (it lost its data) for %.1fs more; "
            "it grants no lock until then: lock %r and other locked runs are %s",
            retry_after,
            name,
            then,
        )
    else:
        logger.debug("lock %r: restart grace for %.1fs more; %s", name, retry_after, then)


def _defer(task: Any, grace: BaseException, countdown: float) -> NoReturn:
    """Send the run again in ``countdown`` seconds, as ``task.retry`` does, but with the
    same ``retries``: a restart grace does not use up the retries meant for contention."""
    request = task.request
    again = task.signature_from_request(request, countdown=countdown, retries=request.retries)
    try:
        again.apply_async()
    except Exception as exc:
        raise Reject(exc, requeue=False) from exc
    raise Retry(exc=grace, when=countdown, sig=again)


def _lost_error(lease: asynclock.Lease) -> asynclock.LeaseLost | None:
    try:
        lease.check()
    except asynclock.LeaseLost as lost:
        return asynclock.LeaseLost(lost.name, lost.token, lost.reason)
    return None


def _run_sync(
    body: Callable[[], Any], lease: asynclock.Lease, hold: _Hold
) -> tuple[Any, BaseException | None]:
    guard = hold.guard = Guard(lease)
    result: Any = None
    error: BaseException | None = None
    lost: asynclock.LeaseLost | None = None
    try:
        try:
            guard.enter()
            with asynclock.use_lease(lease):
                result = body()
        finally:
            lost = _lost_error(lease)  # read as the body ends: a loss after it is no fault
            guard.leave()
    except asynclock.LeaseLost as exc:
        error = exc
        lost = lost or _lost_error(lease)
    except BaseException as exc:
        error = exc
    if lost is not None:
        # The body was interrupted, or swallowed the interruption, or ran past its lease:
        # whatever it returned was done without the lock. The run fails.
        lost.__cause__ = error if error is not None and error is not lost else None
        return None, lost
    return result, error


def _run_async(
    body: Callable[[], Any], lease: asynclock.Lease, hold: _Hold
) -> tuple[Any, BaseException | None]:
    runner = _runner()
    loop = runner.get_loop()
    scope_box: list[anyio.CancelScope] = []

    def cancel_all() -> None:
        for scope in scope_box:
            scope.cancel()

    def cancel() -> None:
        loop.call_soon_threadsafe(cancel_all)

    guard = hold.guard = Guard(lease, cancel)

    async def main() -> Any:
        with anyio.CancelScope() as scope:
            scope_box.append(scope)
            guard.enter()
            try:
                with asynclock.use_lease(lease):
                    return await cast(Coroutine[Any, Any, Any], body())
            finally:
                guard.leave()
        return None

    result: Any = None
    error: BaseException | None = None
    try:
        result = runner.run(main())
    except BaseException as exc:
        error = exc
    lost = _lost_error(lease)
    if lost is not None:
        lost.__cause__ = error if error is not lost else None
        return None, lost
    return result, error


# -- the public API -----------------------------------------------------------------------


class LockedTask(Task):  # type: ignore[misc]  # Celery ships no type information
    """A Celery task base that holds a lock for each *execution*.

    Options (``@app.task(base=LockedTask, lock=..., lock_ttl=..., on_busy=...)``), all
    checked when the task class is made:

    * ``lock``: the lock name, a template formatted from the task's arguments
      (``"report:{customer_id}"``); default: the task's name (one run at a time).
      A field the task does not take is a ``TypeError`` when the task class is made.
    * ``lock_ttl``: the lease's ttl in seconds (renewed every ttl/3 while the body runs;
      at most ``asynclock.MAX_TTL``).
    * ``on_busy``: what a run does when someone else holds the lock:

      - ``"wait"`` (default): wait for it in the worker, in the lock's queue, woken by the
        release; at most ``lock_timeout`` seconds (default ``None``: as long as it takes),
        then the run fails with ``AcquireTimeout``;
      - ``"retry"``: ``self.retry()`` with a countdown of exponential backoff with jitter
        (``lock_retry_backoff`` doubling per retry up to ``lock_retry_backoff_max``; Celery's
        ``max_retries`` applies, then the run fails with ``LockHeld``);
      - ``"skip"``: the run is dropped and logged; it ends SUCCESS with result ``None``;
      - ``"fail"``: the run raises ``LockHeld`` (state FAILURE).

    Whatever ``on_busy`` says, a lock server in its restart grace (``RestartGrace``) makes
    the run wait for the grace's end (a queued run is sent again then, its retries not
    counted), and an unreachable lock server (``BackendUnavailable`` before the body ran)
    makes a queued run retry with backoff, counted against ``max_retries``.
    ``LockHeld`` and ``AcquireTimeout`` are added to the task's ``throws``: Celery logs a
    run that ends with them at INFO, without a traceback.

    In the body: ``self.lease`` (bound tasks), ``self.request.fencing_token`` and
    ``asynclock.current_lease()``. If the lease is lost, the body is interrupted with
    ``LeaseLost`` and the run fails with it, even if the body catches it.
    """

    abstract = True
    lock: ClassVar[str | None] = None
    lock_ttl: ClassVar[float] = Policy.ttl
    on_busy: ClassVar[str] = Policy.on_busy
    lock_timeout: ClassVar[float | None] = None
    lock_retry_backoff: ClassVar[float] = RETRY_BACKOFF
    lock_retry_backoff_max: ClassVar[float] = RETRY_BACKOFF_MAX
    _lock_template: ClassVar[asynclock.NameTemplate | None] = None
    _lock_policy: ClassVar[Policy] = Policy()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._lock_policy = _policy(
            cls.lock_ttl,
            cls.on_busy,
            cls.lock_timeout,
            cls.lock_retry_backoff,
            cls.lock_retry_backoff_max,
            ("lock_ttl", "lock_timeout", "lock_retry_backoff"),
        )
        expected = (asynclock.LockHeld, asynclock.AcquireTimeout)
        throws = tuple(cls.throws or ())
        cls.throws = throws + tuple(e for e in expected if e not in throws)
        if cls.lock is not None:
            template = asynclock.NameTemplate(cls.lock)
            run = cls.__dict__.get("run")
            func = getattr(run, "__func__", run)
            if callable(func):
                template.check_callable(func, what=f"task {func.__qualname__}()")
            cls._lock_template = template

    @property
    def lease(self) -> asynclock.Lease:
        """The lease this run holds."""
        lease = getattr(self.request, "asynclock_lease", None)
        if lease is None:
            raise LookupError(f"task {self.name} holds no asynclock lease outside a run")
        return cast(asynclock.Lease, lease)

    def _plan(self) -> tuple[Namer | None, bool]:
        """(the lock-name function, whether the body is async), made once per ``run``."""
        run = self.run
        key = getattr(run, "__func__", run)
        plan: tuple[object, Namer | None, bool] | None = self.__dict__.get("_asynclock_plan")
        if plan is None or plan[0] is not key:
            template = self._lock_template
            namer = _namer(template, run) if template is not None else None
            plan = (key, namer, inspect.iscoroutinefunction(run))
            self.__dict__["_asynclock_plan"] = plan
        return plan[1], plan[2]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        namer, is_async = self._plan()
        name = namer(args, kwargs) if namer is not None else self.name
        if get_current_task() is self:  # the worker (or apply()) pushed our request
            return run_guarded(
                self,
                lambda: self.run(*args, **kwargs),
                name=name,
                policy=self._lock_policy,
                is_async=is_async,
            )
        # Called directly (`task(...)`): push a request the way Task.__call__ does.
        from celery._state import _task_stack

        _task_stack.push(self)
        self.push_request(args=args, kwargs=kwargs)
        try:
            return run_guarded(
                self,
                lambda: self.run(*args, **kwargs),
                name=name,
                policy=self._lock_policy,
                is_async=is_async,
            )
        finally:
            self.pop_request()
            _task_stack.pop()


def locked(
    template: str,
    *,
    ttl: float = Policy.ttl,
    on_busy: str = Policy.on_busy,
    timeout: float | None = None,
    retry_backoff: float = RETRY_BACKOFF,
    retry_backoff_max: float = RETRY_BACKOFF_MAX,
) -> Callable[[F], F]:
    """Hold a lock named from the call's arguments for each run of a task function.

    For tasks with their own base class: put it under ``@app.task``::

        @app.task(base=MyTask)
        @locked("sync:{account}", ttl=30)
        def sync_account(account): ...

    The options are :class:`LockedTask`'s (``ttl`` is ``lock_ttl``, ``timeout``
    ``lock_timeout``, ``retry_backoff`` ``lock_retry_backoff``), checked here.
    Decorators stack (each holds its own lock, outermost first). The wrapper keeps the
    function's ``__signature__``, so Celery's ``delay()`` still rejects wrong arguments.
    """
    name_template = asynclock.NameTemplate(template)
    policy = _policy(
        ttl, on_busy, timeout, retry_backoff, retry_backoff_max, ("ttl", "timeout", "retry_backoff")
    )

    def decorate(func: F) -> F:
        if not callable(func):
            raise TypeError(f"@locked decorates a function, not {type(func).__name__}")
        name_template.check_callable(func)
        signature = inspect.signature(func)
        is_async = inspect.iscoroutinefunction(func)
        namer = _namer(name_template, func)

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            name = namer(args, kwargs)
            return run_guarded(
                get_current_task(),
                lambda: func(*args, **kwargs),
                name=name,
                policy=policy,
                is_async=is_async,
            )

        wrapper.__signature__ = signature  # type: ignore[attr-defined]
        return cast(F, wrapper)

    return decorate
