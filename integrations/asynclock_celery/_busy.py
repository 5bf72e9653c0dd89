"""What a run does when it did not get its lock (or its idempotency key): wait, retry,
skip or fail, as its ``on_busy`` says; a restart grace and an unreachable server are
nobody's contention and have rules of their own."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, NoReturn, TypeVar

from celery import Celery, current_app
from celery.exceptions import Reject, Retry

import asynclock

from ._policy import Policy
from ._runtime import backend_url

try:  # the otel extra: the run's span (Celery's instrumentation's) carries the token
    from asynclock.otel import annotate_current_span
except ImportError:  # pragma: no cover - depends on the environment
    annotate_current_span = None  # type: ignore[assignment]


logger = logging.getLogger("asynclock.celery")
H = TypeVar("H")


def who(task: Any) -> str:
    return "a direct call" if task is None else f"{task.name}[{task.request.id}]"


def in_progress(task: Any, error: asynclock.InProgress, policy: Policy) -> None:
    """The key's operation runs elsewhere (or still ran when ``lock_timeout`` was up): the
    ``on_busy`` policy, as for a held lock. Returns (skip: the run ends SUCCESS with result
    None) or raises."""
    if task is None or policy.on_busy in ("fail", "wait"):
        raise error
    if policy.on_busy == "skip":
        logger.info("skipped %s: %s", who(task), error)
        return
    raise task.retry(exc=error, countdown=policy.countdown(task.request.retries))


class _State:
    """What this process has already logged (one line per grace, one per outage)."""

    grace_until: float = 0.0
    unavailable: bool = False


state = _State()


def not_acquired(
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
        if not state.unavailable:
            state.unavailable = True
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
    if abs(until - state.grace_until) > 1.0:
        state.grace_until = until
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


# -- the guarded run -----------------------------------------------------------------------


def held(
    task: Any,
    what: str,
    policy: Policy,
    hold: Callable[[str], AbstractContextManager[H]],
    run: Callable[[H], Any],
) -> Any:
    """``run(value)`` inside ``with hold(url) as value`` (``from_thread.hold`` or
    ``from_thread.idempotent``); a hold that cannot be entered goes through the ``on_busy``
    policy (None: skipped)."""
    app: Celery = task.app if task is not None else current_app
    # A run a worker took from the queue can be sent again later; an eager or direct call
    # cannot (Celery's eager retry runs again at once, whatever the countdown).
    request = task.request if task is not None else None  # a lookup in Celery's stack
    queued = request is not None and not request.is_eager and not request.called_directly
    while True:
        entered = False
        try:
            with hold(backend_url(app)) as value:
                entered = True
                state.unavailable = False
                return run(value)
        except asynclock.InProgress as exc:
            if entered:
                raise  # the body's own
            in_progress(task, exc, policy)  # raises, unless on_busy="skip"
            return None
        except (asynclock.LockHeld, asynclock.AcquireTimeout, asynclock.BackendUnavailable) as exc:
            if entered:
                raise
            again = not_acquired(task, what, exc, policy, queued)
            if again is None:
                return None  # skipped
            time.sleep(again)  # an eager or direct run in a restart grace: wait it out here


def annotate(
    task: Any,
    lease: asynclock.Lease,
    template: asynclock.NameTemplate | None,
    default: str | None = None,
) -> None:
    """The lease on the run's request, and its token and name template on the run's span
    if one records (OpenTelemetry)."""
    if task is not None:
        request = task.request
        request.asynclock_lease = lease
        request.fencing_token = lease.token
    if annotate_current_span is not None:
        annotate_current_span(lease, template.template if template is not None else default)
