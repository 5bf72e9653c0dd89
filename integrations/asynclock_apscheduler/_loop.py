"""The lock target a scheduler names, and the bridge (asynclock.from_thread) it is held on."""

from __future__ import annotations

import asynclock
from asynclock import from_thread


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


class Bridge:
    """The executor's (or campaign's) :class:`asynclock.from_thread.LoopThread` and its
    open backend, from ``open()`` to ``close()``. A Backend passed in is owned by the
    thread from then on."""

    def __init__(self, target: str | asynclock.Backend) -> None:
        self._target = target
        self.thread: from_thread.LoopThread | None = None
        self.backend: asynclock.Backend | None = None

    def open(self) -> None:
        if self.thread is not None:
            raise RuntimeError("this executor is already started")
        thread = from_thread.LoopThread(name="asynclock-apscheduler")
        try:
            self.backend = thread.backend(self._target)
        except BaseException:
            thread.close()
            raise
        self.thread = thread

    def close(self) -> None:
        thread, self.thread, self.backend = self.thread, None, None
        if thread is not None:
            thread.close()

    def require(self) -> tuple[from_thread.LoopThread, asynclock.Backend]:
        if self.thread is None or self.backend is None:
            raise RuntimeError("not started: the scheduler starts this executor")
        return self.thread, self.backend
