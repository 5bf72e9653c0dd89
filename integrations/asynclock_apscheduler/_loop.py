"""The background event-loop thread a sync framework holds its leases through."""

from __future__ import annotations

from contextlib import AbstractContextManager

import anyio.from_thread

import asynclock


def check_target(url_or_backend: object) -> str | asynclock.Backend:
    if isinstance(url_or_backend, str):
        if "://" not in url_or_backend:
            raise ValueError(
                f"url_or_backend must be a lock URL like 'redis://host:6379/0' or "
                f"'sqlite:///locks.db', got {url_or_backend!r}"
            )
        return url_or_backend
    if isinstance(url_or_backend, asynclock.Backend):
        return url_or_backend
    raise TypeError(
        "url_or_backend must be a lock URL (str) or an asynclock.Backend that is not open "
        f"yet, not {type(url_or_backend).__name__}"
    )


class LoopThread:
    """One event loop in its own thread, with one open backend on it.

    ``open()`` starts the thread and opens the backend (a URL is connected, a Backend is
    entered); ``close()`` closes the backend (releasing what it still holds) and ends the
    thread. A Backend passed in is owned by this thread from then on.
    """

    def __init__(self, target: str | asynclock.Backend) -> None:
        self._target = target
        self._portal_cm: AbstractContextManager[anyio.from_thread.BlockingPortal] | None = None
        self._backend_cm: AbstractContextManager[asynclock.Backend] | None = None
        self.portal: anyio.from_thread.BlockingPortal | None = None
        self.backend: asynclock.Backend | None = None

    def open(self) -> None:
        if self.portal is not None:
            raise RuntimeError("this executor is already started")
        target = self._target
        backend = target if isinstance(target, asynclock.Backend) else asynclock.connect(target)
        self._portal_cm = anyio.from_thread.start_blocking_portal(name="asynclock")
        portal = self._portal_cm.__enter__()
        try:
            self._backend_cm = portal.wrap_async_context_manager(backend)
            self.backend = self._backend_cm.__enter__()
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            self._portal_cm = None
            raise
        self.portal = portal

    def close(self) -> None:
        backend_cm, self._backend_cm = self._backend_cm, None
        portal_cm, self._portal_cm = self._portal_cm, None
        self.portal = self.backend = None
        try:
            if backend_cm is not None:
                backend_cm.__exit__(None, None, None)
        finally:
            if portal_cm is not None:
                portal_cm.__exit__(None, None, None)

    def require(self) -> tuple[anyio.from_thread.BlockingPortal, asynclock.Backend]:
        if self.portal is None or self.backend is None:
            raise RuntimeError("not started: the scheduler starts this executor")
        return self.portal, self.backend
