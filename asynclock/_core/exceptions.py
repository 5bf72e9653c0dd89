"""The exception hierarchy: one root, builtin bases where an error resembles one."""

from __future__ import annotations

from collections.abc import Mapping


class AsynclockError(Exception):
    """Root of every error asynclock raises on purpose."""


class LockHeld(AsynclockError):
    """``blocking=False`` and someone else holds the lock right now."""

    def __init__(
        self, name: str, retry_after: float | None = None, detail: str | None = None
    ) -> None:
        hint = f"; it frees in at most {retry_after:.3f}s" if retry_after is not None else ""
        if detail:
            hint = f"; {detail}"
        super().__init__(f"lock {name!r} is held by another owner{hint}")
        self.name = name
        self.retry_after = retry_after


class AlreadyHeld(LockHeld):
    """This task is already inside ``async with backend.lock(name)`` for the same name on
    the same backend. Locks are not re-entrant: waiting would wait for itself forever.

    ``token`` is the outer hold's fencing token.
    """

    def __init__(self, name: str, token: int) -> None:
        AsynclockError.__init__(
            self,
            f"lock {name!r} is already held by this task (outer `async with "
            f"backend.lock({name!r})`, token {token}); locks are not re-entrant: use the "
            "outer lease (asynclock.current_lease()) instead of locking the name again",
        )
        self.name = name
        self.retry_after = None
        self.token = token


class AcquireTimeout(AsynclockError, TimeoutError):
    """The lock was not acquired within ``timeout`` seconds."""

    def __init__(self, name: str, timeout: float) -> None:
        super().__init__(f"lock {name!r} was not acquired within {timeout:g}s")
        self.name = name
        self.timeout = timeout


class LeaseLost(AsynclockError):
    """The lease ended before the holder was done; its work was cancelled.

    ``reason`` says why: the renewal was refused, the local deadline passed, the
    connection or session carrying the lock is gone, ``max_hold`` was reached, ...
    """

    def __init__(self, name: str, token: int, reason: str) -> None:
        super().__init__(f"lease on {name!r} (token {token}) was lost: {reason}")
        self.name = name
        self.token = token
        self.reason = reason


class StaleToken(AsynclockError):
    """A fenced write carried a token older than the newest one the resource accepted.

    Nothing was written.
    """

    def __init__(self, key: str, token: int, current: int | None) -> None:
        cur = f"; the resource has already accepted token {current}" if current is not None else ""
        super().__init__(f"stale fencing token {token} for {key!r}{cur}; nothing was written")
        self.key = key
        self.token = token
        self.current = current


class BackendUnavailable(AsynclockError, ConnectionError):
    """The backend could not be reached, opened or used."""


class QuorumNotReached(BackendUnavailable):
    """Fewer than a quorum of nodes answered (Redlock). ``failures`` maps node to reason."""

    def __init__(self, message: str, failures: Mapping[str, str] | None = None) -> None:
        detail = ""
        if failures:
            detail = "; " + ", ".join(f"{node}: {why}" for node, why in failures.items())
        super().__init__(message + detail)
        self.failures: dict[str, str] = dict(failures or {})
