"""``LockedTask`` and ``@locked``: hold a lease for a task's execution.

Private Celery API used here, pinned by
``tests/integrations/test_celery.py::test_the_private_celery_api_locked_task_uses_is_still_there``:
``celery._state.get_current_task`` and ``celery._state._task_stack`` (see ``__call__``).
"""

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
from typing import Any, ClassVar, NoReturn, TypeVar, cast

import anyio
from celery import Celery, Task, current_app
from celery._state import get_current_task
from celery.exceptions import Reject, Retry

import asynclock
from asynclock.from_thread import BodyGuard, Guarded, Handover, lost_error, run_body

from ._idempotent import (
    DEFAULT_KEEP,
    Idempotency,
    IdempotentRun,
    arguments_of,
    check_idempotency,
)
from ._policy import RETRY_BACKOFF, RETRY_BACKOFF_MAX, Namer, Policy, _namer, _policy
from ._runtime import backend_url, get_runtime

try:  # the otel extra: the run's span (Celery's instrumentation's) carries the token
    from asynclock.otel import annotate_current_span
except ImportError:  # pragma: no cover - depends on the environment
    annotate_current_span = None  # type: ignore[assignment]

logger = logging.getLogger("asynclock.celery")
F = TypeVar("F", bound=Callable[..., Any])

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


def run_guarded(
    task: Any,
    body: Callable[[], Any],
    *,
    name: str,
    policy: Policy,
    is_async: bool,
    template: asynclock.NameTemplate | None = None,
) -> Any:
    """Run ``body`` holding ``name``; see :class:`LockedTask` for the contract."""
    app: Celery = task.app if task is not None else current_app
    runtime = get_runtime()
    # A run a worker took from the queue can be sent again later; an eager or direct call
    # cannot (Celery's eager retry runs again at once, whatever the countdown).
    request = task.request if task is not None else None  # a lookup in Celery's stack
    queued = request is not None and not request.is_eager and not request.called_directly
    while True:
        hold = Handover(runtime.loop)
        try:
            backend = runtime.backend(backend_url(app))
            wait = policy.on_busy == "wait"
            hold.begin(backend, name, ttl=policy.ttl, blocking=wait, timeout=policy.timeout)
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
        if request is not None:
            request.asynclock_lease = lease
            request.fencing_token = lease.token
        _annotate(lease, template)
        if is_async:
            result, error = _run_async(body, lease, hold)
        else:
            result, error = run_body(body, lease, hold)
    finally:
        hold.end()
    if error is not None:
        raise error
    return result


def run_idempotent(
    task: Any,
    body: Callable[[], Any],
    *,
    key: str,
    fingerprint: object,
    idempotency: Idempotency,
    policy: Policy,
    is_async: bool,
) -> Any:
    """Run ``body`` once per ``key`` (``backend.idempotent``): the stored result of a run
    that completed before is returned without running it; see :class:`LockedTask`."""
    app: Celery = task.app if task is not None else current_app
    runtime = get_runtime()
    queued = task is not None and not task.request.is_eager and not task.request.called_directly
    wait: float | None = None
    if policy.on_busy == "wait":
        wait = math.inf if policy.timeout is None else policy.timeout
    while True:
        run = IdempotentRun(runtime.loop)
        try:
            backend = runtime.backend(backend_url(app))
            guard = backend.idempotent(
                key,
                ttl=policy.ttl,
                fingerprint=fingerprint,
                keep=idempotency.keep,
                wait=wait,
                store_errors=idempotency.store_errors,
            )
            run.begin(guard)
        except asynclock.BackendUnavailable as exc:
            run.error = exc
        if run.error is None:
            break
        if isinstance(run.error, asynclock.InProgress):
            _in_progress(task, run.error, policy)  # raises, unless on_busy="skip"
            return None
        again = _not_acquired(task, key, run.error, policy, queued)
        if again is None:
            return None
        time.sleep(again)
    _state.unavailable = False
    call = run.call
    assert call is not None
    if task is not None:
        task.request.idempotency_key = key
        task.request.idempotency_replayed = call.replayed
    if call.replayed:
        logger.info("%s: idempotency key %r: replayed the stored result", _who(task), key)
        return call.result
    lease = call.lease
    assert lease is not None
    if task is not None:
        task.request.asynclock_lease = lease
        task.request.fencing_token = lease.token
    _annotate(lease, idempotency.key, "idempotency:*")
    if is_async:
        result, error = _run_async(body, lease, run)
    else:
        result, error = run_body(body, lease, run)
    run.end(result, error)
    if run.error is not None:
        raise run.error
    if error is not None:  # not an Exception (SystemExit ...): the key was freed
        raise error
    return result


def _annotate(
    lease: asynclock.Lease, template: asynclock.NameTemplate | None, default: str | None = None
) -> None:
    """The token and the name template on the run's span, if one records (OpenTelemetry)."""
    if annotate_current_span is not None:
        annotate_current_span(lease, template.template if template is not None else default)


def _who(task: Any) -> str:
    return "a direct call" if task is None else f"{task.name}[{task.request.id}]"


def _in_progress(task: Any, error: asynclock.InProgress, policy: Policy) -> None:
    """The key's operation runs elsewhere (or still ran when ``lock_timeout`` was up): the
    ``on_busy`` policy, as for a held lock. Returns (skip: the run ends SUCCESS with result
    None) or raises."""
    if task is None or policy.on_busy in ("fail", "wait"):
        raise error
    if policy.on_busy == "skip":
        logger.info("skipped %s: %s", _who(task), error)
        return
    raise task.retry(exc=error, countdown=policy.countdown(task.request.retries))


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


def _run_async(
    body: Callable[[], Any], lease: asynclock.Lease, hold: Guarded
) -> tuple[Any, BaseException | None]:
    runner = _runner()
    loop = runner.get_loop()
    scope_box: list[anyio.CancelScope] = []

    def cancel_all() -> None:
        for scope in scope_box:
            scope.cancel()

    def cancel() -> None:
        loop.call_soon_threadsafe(cancel_all)

    guard = hold.guard = BodyGuard(lease, cancel)

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
    lost = lost_error(lease)
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

    Idempotent tasks (``idempotent=True``; docs/integrations/celery.md): each run is keyed,
    and a run whose key completed before (a redelivery, a re-sent task) returns the stored
    result (the body's return value, as JSON) without running the body:

    * ``idempotency_key``: a template of the task's arguments (``"charge:{order_id}"``);
      default: ``lock`` if set, else the task's name and a hash of all its arguments;
    * ``idempotency_fingerprint``: the argument names whose values must match for a
      replay (default None: all of them; ``()``: none); another value under the same key
      fails the run with ``IdempotencyKeyReused``, nothing run;
    * ``idempotency_keep``: seconds a stored result is kept (1 s to 30 days; 24 h);
    * ``idempotency_store_errors``: exception classes stored as the outcome and replayed
      as ``ReplayedFailure``; any other error frees the key, so a retry runs the body.

    The run holds the key's lease (``lock_ttl``, renewed; ``self.lease``, the fencing
    token) instead of the ``lock``'s, and stores the result only while that lease is live
    (fenced: a run presumed dead cannot overwrite its successor's result). A run that
    finds the key running elsewhere follows ``on_busy`` (``"wait"``: for its result,
    ``lock_timeout`` bounding the wait, then ``InProgress``; ``"retry"``, ``"skip"``,
    ``"fail"``: with ``InProgress``).
    """

    abstract = True
    lock: ClassVar[str | None] = None
    lock_ttl: ClassVar[float] = Policy.ttl
    on_busy: ClassVar[str] = Policy.on_busy
    lock_timeout: ClassVar[float | None] = None
    lock_retry_backoff: ClassVar[float] = RETRY_BACKOFF
    lock_retry_backoff_max: ClassVar[float] = RETRY_BACKOFF_MAX
    idempotent: ClassVar[bool] = False
    idempotency_key: ClassVar[str | None] = None
    idempotency_fingerprint: ClassVar[tuple[str, ...] | None] = None
    idempotency_keep: ClassVar[float] = DEFAULT_KEEP
    idempotency_store_errors: ClassVar[tuple[type[Exception], ...]] = ()
    _lock_template: ClassVar[asynclock.NameTemplate | None] = None
    _lock_policy: ClassVar[Policy] = Policy()
    _idempotency: ClassVar[Idempotency | None] = None

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
        expected = (asynclock.LockHeld, asynclock.AcquireTimeout, asynclock.InProgress)
        throws = tuple(cls.throws or ())
        cls.throws = throws + tuple(e for e in expected if e not in throws)
        run = cls.__dict__.get("run")
        func = getattr(run, "__func__", run)
        if cls.lock is not None:
            template = asynclock.NameTemplate(cls.lock)
            if callable(func):
                template.check_callable(func, what=f"task {func.__qualname__}()")
            cls._lock_template = template
        if cls.idempotent:
            cls._idempotency = check_idempotency(
                cls.idempotency_key or cls.lock,
                cls.idempotency_fingerprint,
                cls.idempotency_keep,
                cls.idempotency_store_errors,
                func if callable(func) else None,
                _CLASS_NAMES,
            )
        elif any(getattr(cls, n) != getattr(LockedTask, n) for n in _CLASS_NAMES):
            raise ValueError(
                f"{', '.join(n for n in _CLASS_NAMES if getattr(cls, n) != getattr(LockedTask, n))}"
                " set without idempotent=True: set it too to make the task idempotent"
            )

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
        idempotency = self._idempotency
        if idempotency is not None:
            arguments = arguments_of(self.run, args, kwargs)
            key = idempotency.key_of(self.name, arguments)
            prints = idempotency.fingerprint_of(arguments)

            def guarded() -> Any:
                return run_idempotent(
                    self,
                    lambda: self.run(*args, **kwargs),
                    key=key,
                    fingerprint=prints,
                    idempotency=idempotency,
                    policy=self._lock_policy,
                    is_async=is_async,
                )
        else:
            name = namer(args, kwargs) if namer is not None else self.name

            def guarded() -> Any:
                return run_guarded(
                    self,
                    lambda: self.run(*args, **kwargs),
                    name=name,
                    policy=self._lock_policy,
                    is_async=is_async,
                    template=self._lock_template,
                )

        if get_current_task() is self:  # the worker (or apply()) pushed our request
            return guarded()
        # Called directly (`task(...)`): push a request the way Task.__call__ does.
        from celery._state import _task_stack

        _task_stack.push(self)
        self.push_request(args=args, kwargs=kwargs)
        try:
            return guarded()
        finally:
            self.pop_request()
            _task_stack.pop()


#: LockedTask's idempotency options, as the user spells them on the class.
_CLASS_NAMES = (
    "idempotency_key",
    "idempotency_fingerprint",
    "idempotency_keep",
    "idempotency_store_errors",
)


def locked(
    template: str,
    *,
    ttl: float = Policy.ttl,
    on_busy: str = Policy.on_busy,
    timeout: float | None = None,
    retry_backoff: float = RETRY_BACKOFF,
    retry_backoff_max: float = RETRY_BACKOFF_MAX,
    idempotent: bool = False,
    fingerprint: tuple[str, ...] | None = None,
    keep: float = DEFAULT_KEEP,
    store_errors: tuple[type[Exception], ...] = (),
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

    ``idempotent=True``: ``template`` is the idempotency key instead (a run whose key
    completed before returns the stored result without running); ``fingerprint``,
    ``keep`` and ``store_errors`` are :class:`LockedTask`'s ``idempotency_fingerprint``,
    ``idempotency_keep`` and ``idempotency_store_errors``.
    """
    name_template = asynclock.NameTemplate(template)
    policy = _policy(
        ttl, on_busy, timeout, retry_backoff, retry_backoff_max, ("ttl", "timeout", "retry_backoff")
    )
    if not isinstance(idempotent, bool):
        raise TypeError(f"idempotent must be True or False, got {idempotent!r}")
    if not idempotent and (fingerprint is not None or keep != DEFAULT_KEEP or store_errors):
        raise ValueError(
            "fingerprint, keep and store_errors are options of idempotent tasks: "
            "pass idempotent=True too"
        )
    names = ("template", "fingerprint", "keep", "store_errors")
    idempotency = check_idempotency(template, fingerprint, keep, store_errors, None, names)

    def decorate(func: F) -> F:
        if not callable(func):
            raise TypeError(f"@locked decorates a function, not {type(func).__name__}")
        name_template.check_callable(func)
        signature = inspect.signature(func)
        is_async = inspect.iscoroutinefunction(func)
        namer = _namer(name_template, func)
        if idempotent:
            check_idempotency(template, fingerprint, keep, store_errors, func, names)

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if idempotent:
                arguments = arguments_of(func, args, kwargs)
                return run_idempotent(
                    get_current_task(),
                    lambda: func(*args, **kwargs),
                    key=idempotency.key_of("", arguments),
                    fingerprint=idempotency.fingerprint_of(arguments),
                    idempotency=idempotency,
                    policy=policy,
                    is_async=is_async,
                )
            name = namer(args, kwargs)
            return run_guarded(
                get_current_task(),
                lambda: func(*args, **kwargs),
                name=name,
                policy=policy,
                is_async=is_async,
                template=name_template,
            )

        wrapper.__signature__ = signature  # type: ignore[attr-defined]
        return cast(F, wrapper)

    return decorate
