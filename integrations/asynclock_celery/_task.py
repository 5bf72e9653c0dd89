"""``LockedTask`` and ``@locked``: hold a lease for a task's execution.

Private Celery API used here, pinned by
``tests/integrations/test_celery.py::test_the_private_celery_api_locked_task_uses_is_still_there``:
``celery._state.get_current_task`` and ``celery._state._task_stack`` (see ``__call__``).
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar, cast

from celery import Task
from celery._state import get_current_task

import asynclock
from asynclock import from_thread
from asynclock.idempotency import DEFAULT_KEEP, KeyedCalls

from ._busy import annotate as _annotate
from ._busy import held as _held
from ._busy import who
from ._idempotent import arguments_of, check_idempotency
from ._permit import check_limit, run_limited
from ._policy import RETRY_BACKOFF, RETRY_BACKOFF_MAX, Namer, Policy, _namer, _policy
from ._runtime import get_runtime, run_body

logger = logging.getLogger("asynclock.celery")
F = TypeVar("F", bound=Callable[..., Any])
H = TypeVar("H")

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
    runtime = get_runtime()
    wait = policy.on_busy == "wait"
    ttl, timeout = policy.ttl, policy.timeout

    def run(lease: asynclock.Lease) -> Any:
        _annotate(task, lease, template)
        return run_body(body, lease, runtime.loop, is_async)

    return _held(
        task,
        name,
        policy,
        lambda url: from_thread.hold(runtime, url, name, ttl=ttl, blocking=wait, timeout=timeout),
        run,
    )


def run_idempotent(
    task: Any,
    body: Callable[[], Any],
    *,
    key: str,
    fingerprint: object,
    calls: KeyedCalls,
    policy: Policy,
    is_async: bool,
) -> Any:
    """Run ``body`` once per ``key`` (``backend.idempotent``): the stored result of a run
    that completed before is returned without running it; see :class:`LockedTask`."""
    runtime = get_runtime()
    wait: float | None = None
    if policy.on_busy == "wait":
        wait = math.inf if policy.timeout is None else policy.timeout

    def run(op: Any) -> Any:  # from_thread.idempotent's body: replayed, result, lease, save()
        if task is not None:
            task.request.idempotency_key = key
            task.request.idempotency_replayed = op.replayed
        if op.replayed:
            logger.info("%s: idempotency key %r: replayed the stored result", who(task), key)
            return op.result
        assert op.lease is not None
        _annotate(task, op.lease, calls.template, "idempotency:*")
        result = run_body(body, op.lease, runtime.loop, is_async)
        op.save(result)  # stored, fenced, as the block exits
        return result

    return _held(
        task,
        key,
        policy,
        lambda url: from_thread.idempotent(
            runtime,
            url,
            key,
            ttl=policy.ttl,
            fingerprint=fingerprint,
            keep=calls.keep,
            wait=wait,
            store_errors=calls.store_errors,
        ),
        run,
    )


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

    * ``lock_limit``: ``None`` (default: a lock, one run at a time), or N (1 .. 10 000): at
      most N runs of the name at once across the fleet, each holding one of N permits of
      the semaphore ``backend.semaphore(name, N)``; a run that finds all N held follows
      ``on_busy``. ``self.permit`` (``.slot``, ``.token``) in the body.

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
    lock_limit: ClassVar[int | None] = None
    idempotent: ClassVar[bool] = False
    idempotency_key: ClassVar[str | None] = None
    idempotency_fingerprint: ClassVar[tuple[str, ...] | None] = None
    idempotency_keep: ClassVar[float] = DEFAULT_KEEP
    idempotency_store_errors: ClassVar[tuple[type[Exception], ...]] = ()
    _lock_template: ClassVar[asynclock.NameTemplate | None] = None
    _lock_policy: ClassVar[Policy] = Policy()
    _idempotency: ClassVar[KeyedCalls | None] = None

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
        check_limit(cls.lock_limit)
        if cls.lock_limit is not None and cls.idempotent:
            raise ValueError(
                "lock_limit and idempotent=True do not combine: an idempotency key runs "
                "once at a time by definition; drop one of them"
            )
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

    @property
    def permit(self) -> asynclock.Permit:
        """The semaphore permit this run holds (``lock_limit``): ``.slot``, ``.token``."""
        permit = getattr(self.request, "asynclock_permit", None)
        if permit is None:
            raise LookupError(f"task {self.name} holds no asynclock permit (lock_limit) here")
        return cast(asynclock.Permit, permit)

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
        calls = self._idempotency
        if calls is not None:
            arguments = arguments_of(self.run, args, kwargs)
            key = calls.key(arguments, self.name)
            prints = calls.fingerprint_of(arguments)

            def guarded() -> Any:
                return run_idempotent(
                    self,
                    lambda: self.run(*args, **kwargs),
                    key=key,
                    fingerprint=prints,
                    calls=calls,
                    policy=self._lock_policy,
                    is_async=is_async,
                )
        else:
            name = namer(args, kwargs) if namer is not None else self.name
            limit = self.lock_limit

            def guarded() -> Any:
                if limit is not None:
                    return run_limited(
                        self,
                        lambda: self.run(*args, **kwargs),
                        name=name,
                        limit=limit,
                        policy=self._lock_policy,
                        is_async=is_async,
                        template=self._lock_template,
                    )
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
    limit: int | None = None,
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
    ``idempotency_keep`` and ``idempotency_store_errors``. ``limit`` is
    :class:`LockedTask`'s ``lock_limit`` (at most ``limit`` runs of the name at once).
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
    if check_limit(limit, "limit") is not None and idempotent:
        raise ValueError("limit and idempotent=True do not combine: drop one of them")
    names = ("template", "fingerprint", "keep", "store_errors")
    calls = check_idempotency(template, fingerprint, keep, store_errors, None, names)

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
                    key=calls.key(arguments),
                    fingerprint=calls.fingerprint_of(arguments),
                    calls=calls,
                    policy=policy,
                    is_async=is_async,
                )
            name = namer(args, kwargs)
            if limit is not None:
                return run_limited(
                    get_current_task(),
                    lambda: func(*args, **kwargs),
                    name=name,
                    limit=limit,
                    policy=policy,
                    is_async=is_async,
                    template=name_template,
                )
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
