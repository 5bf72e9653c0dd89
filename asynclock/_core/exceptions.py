"""The exception hierarchy: one root, builtin bases where an error resembles one."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any


class AsynclockError(Exception):
    """Root of every error asynclock raises on purpose.

    Every subclass survives a pickle round trip with its message and fields (Celery's
    result backends and multiprocessing pools pickle exceptions): ``__reduce__`` rebuilds
    it from the constructor arguments in ``_fields`` (or from ``args`` if none).
    """

    #: Constructor arguments, in order, each kept as an attribute of the same name.
    _fields: tuple[str, ...] = ()

    def __str__(self) -> str:
        message = self.__dict__.get("_message")
        return message if isinstance(message, str) else super().__str__()

    def __reduce__(self) -> tuple[Any, ...]:
        if not self._fields:
            return (type(self), self.args, self.__dict__ or None)
        return (type(self), tuple(getattr(self, f) for f in self._fields), self.__dict__)


class _FieldArgs(AsynclockError):
    """``args`` are the constructor arguments (and ``str()`` the message), so serializers
    that rebuild an exception as ``cls(*args)`` (Celery's JSON result backend) get it back."""

    def __init__(self, message: str, *fields: Any) -> None:
        super().__init__(*fields)
        self._message = message


class LockHeld(_FieldArgs):
    """``blocking=False`` and someone else holds the lock right now.

    ``label`` is the holder's owner label (``connect(url, owner_label=...)``, default
    ``host:pid``) where the backend's busy answer says who holds (memory, SQLite), else
    None (ask ``backend.holder(name)``).
    """

    _fields: tuple[str, ...] = ("name", "retry_after", "detail", "label")

    def __init__(
        self,
        name: str,
        retry_after: float | None = None,
        detail: str | None = None,
        label: str | None = None,
    ) -> None:
        # What is known: the current lease's time left, which a live holder keeps renewing.
        hint = (
            f"; its lease ends in {retry_after:.3f}s unless its holder renews it"
            if retry_after is not None
            else ""
        )
        if detail:
            hint = f"; {detail}"
        who = "another owner" if label is None else f"another owner ({label!r})"
        super().__init__(f"lock {name!r} is held by {who}{hint}", name, retry_after, detail, label)
        self.detail = detail
        self.label = label
        self.name = name
        self.retry_after = retry_after


class AlreadyHeld(LockHeld):
    """This task already holds ``name`` on the same backend, inside ``async with
    backend.lock(name)`` or a leadership term of ``name`` (``async with
    backend.leadership(name)``, ``async with term``), and asked for it again: a ``lock()``,
    ``acquire()`` or ``leadership()`` of the same name. Holds are not re-entrant: waiting
    would wait for itself forever.

    ``token`` is the outer hold's fencing token; ``outer`` says what the outer hold is:
    ``"lock"``, ``"lock_all"`` or ``"leadership"``.
    """

    _fields = ("name", "token", "outer")

    def __init__(self, name: str, token: int, outer: str = "lock") -> None:
        if outer == "leadership":
            where = (
                f"a leadership term: outer `async with backend.leadership({name!r})` or "
                "`async with term`"
            )
        elif outer == "lock_all":
            where = f"outer `async with backend.lock_all([...])` that takes {name!r}"
        else:
            where = f"outer `async with backend.lock({name!r})`"
        _FieldArgs.__init__(
            self,
            f"lock {name!r} is already held by this task ({where}, token {token}); holds "
            "are not re-entrant: use the outer lease (asynclock.current_lease()) instead of "
            "locking or campaigning for the name again",
            name,
            token,
            outer,
        )
        self.detail = None
        self.label = None
        self.name = name
        self.outer = outer
        self.retry_after = None
        self.token = token


class RestartGrace(LockHeld):
    """The backend's server lost its data a short while ago (a new or flushed database, a
    restart without persistence) and grants no lock until ``until``: a lease granted
    before the loss may still be running in its holder (G1 across data loss).

    Nobody holds the name that the server knows of; this is not a conflict with another
    owner but a wait with a known end. ``retry_after`` is the seconds left, ``until`` the
    end as a Unix time on the server's clock. A :class:`LockHeld`, so code that treats
    "busy" as "try later" keeps working; code that can tell the two apart (an HTTP 503
    instead of a 409) catches this first.
    """

    _fields = ("name", "retry_after", "until", "detail")

    def __init__(
        self, name: str, retry_after: float, until: float, detail: str | None = None
    ) -> None:
        end = time.strftime("%H:%M:%S", time.gmtime(until)) + f".{int(until * 1000) % 1000:03d}"
        why = detail or "the server lost its data a short while ago"
        _FieldArgs.__init__(
            self,
            f"lock {name!r} is not granted before {end} UTC ({retry_after:.3f}s from now), "
            f"the end of the restart grace: {why}",
            name,
            retry_after,
            until,
            detail,
        )
        self.name = name
        self.retry_after = retry_after
        self.until = until
        self.detail = detail
        self.label = None


class AcquireTimeout(AsynclockError, TimeoutError):
    """The lock was not acquired within ``timeout`` seconds.

    ``detail``, if set, says what the last attempt found (for example a restart grace).
    """

    _fields = ("name", "timeout", "detail")

    def __init__(self, name: str, timeout: float, detail: str | None = None) -> None:
        why = f": {detail}" if detail else ""
        super().__init__(f"lock {name!r} was not acquired within {timeout:g}s{why}")
        self.name = name
        self.timeout = timeout
        self.detail = detail


class LeaseLost(_FieldArgs):
    """The lease ended before the holder was done; its work was cancelled.

    ``reason`` says why: the renewal was refused, the local deadline passed, the
    connection or session carrying the lock is gone, ``max_hold`` was reached, ...
    """

    _fields = ("name", "token", "reason")

    def __init__(self, name: str, token: int, reason: str) -> None:
        super().__init__(
            f"lease on {name!r} (token {token}) was lost: {reason}", name, token, reason
        )
        self.name = name
        self.token = token
        self.reason = reason


class StaleToken(_FieldArgs):
    """A fenced write carried a token older than the newest one the resource accepted.

    Nothing was written.
    """

    _fields = ("key", "token", "current")

    def __init__(self, key: str, token: int, current: int | None) -> None:
        cur = f"; the resource has already accepted token {current}" if current is not None else ""
        super().__init__(
            f"stale fencing token {token} for {key!r}{cur}; nothing was written",
            key,
            token,
            current,
        )
        self.key = key
        self.token = token
        self.current = current


class BackendUnavailable(AsynclockError, ConnectionError):
    """The backend could not be reached, opened or used."""


class QuorumNotReached(BackendUnavailable):
    """Fewer than a quorum of nodes answered (Redlock). ``failures`` maps node to reason."""

    _fields = ("message", "failures")

    def __init__(self, message: str, failures: Mapping[str, str] | None = None) -> None:
        detail = ""
        if failures:
            detail = "; " + ", ".join(f"{node}: {why}" for node, why in failures.items())
        super().__init__(message + detail)
        self.message = message
        self.failures: dict[str, str] = dict(failures or {})


class ServerFull(AsynclockError):
    """The server refused a new acquisition because one of its own ceilings is reached
    (PostgreSQL ``mode=session``: its shared lock table). Nothing already held is lost; the
    message names the setting and the way out. Retry later, or raise the ceiling."""


class InProgress(_FieldArgs):
    """Another caller is running the idempotent operation of ``key`` right now.

    ``waited`` is how long this caller waited for it to finish (its ``wait``), or None if
    it did not wait. Nothing ran here; try again later, or pass ``wait=`` to wait for the
    other caller's result.
    """

    _fields = ("key", "waited")

    def __init__(self, key: str, waited: float | None = None) -> None:
        how = (
            f"it did not finish within wait={waited:g}s"
            if waited is not None
            else "pass wait=<seconds> to wait for its result instead"
        )
        super().__init__(
            f"idempotent operation {key!r} is in progress in another caller; {how}",
            key,
            waited,
        )
        self.key = key
        self.waited = waited


class IdempotencyKeyReused(_FieldArgs, ValueError):
    """The idempotency ``key`` is recorded with other arguments (another fingerprint) than
    this call's: the same key was used for a different request. Nothing ran here."""

    _fields = ("key",)

    def __init__(self, key: str) -> None:
        super().__init__(
            f"idempotency key {key!r} was used before with different arguments (another "
            "fingerprint); use a new key for a different request",
            key,
        )
        self.key = key


class ReplayedFailure(_FieldArgs):
    """The idempotent operation of ``key`` failed before with an error its caller chose to
    store (``store_errors``); this is that failure, replayed without running it again.

    ``error_type`` is the original exception's class (``module.QualName``), ``message``
    its ``str()`` (at most 4,096 characters).
    """

    _fields = ("key", "error_type", "message")

    def __init__(self, key: str, error_type: str, message: str) -> None:
        super().__init__(
            f"idempotent operation {key!r} failed before with {error_type}: {message} "
            "(a stored failure, replayed without running the operation again)",
            key,
            error_type,
            message,
        )
        self.key = key
        self.error_type = error_type
        self.message = message


class SemaphoreLimitMismatch(_FieldArgs, ValueError):
    """``backend.semaphore(name, limit)`` was asked for a permit while permits of ``name``
    are held under another limit (``held_limit``): the limit is fixed while any permit of
    the name is live, and takes a new value once every permit is released or expired
    (docs/semaphores.md)."""

    _fields = ("name", "limit", "held_limit")

    def __init__(self, name: str, limit: int, held_limit: int) -> None:
        super().__init__(
            f"semaphore {name!r} was asked for with limit={limit}, but its live permits "
            f"were granted with limit={held_limit}: use one limit per name (a new limit "
            "takes effect once every permit of the name is released or expired)",
            name,
            limit,
            held_limit,
        )
        self.name = name
        self.limit = limit
        self.held_limit = held_limit
