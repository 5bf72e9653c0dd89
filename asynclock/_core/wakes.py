"""Wake-ups across processes for holds that are not locks (a semaphore's permits, a
read-write lock's holds): they ride on the backend's own lock notifications.

A waiter for such a hold watches, through its driver's lock :meth:`~.driver.Driver.watch`,
the reserved name :func:`wake_name` of its lease name (``\\x00asynclock.wake:semaphore:<name>``,
``\\x00asynclock.wake:rwlock:<name>``): a name no user lock can have
(``RESERVED_PREFIX``). The store's release notifies that name's channel the same way a
lock's release notifies its own (Redis ``PUBLISH``, PostgreSQL ``NOTIFY``), and the
driver's ``wake(wake_name)`` reaches the waiters of the lease name (the core maps it back,
:func:`woken_name`). Polling stays the fallback: a missed notification delays a waiter by
at most its poll interval, never strands it.
"""

from __future__ import annotations

from typing import Protocol

from .validation import RESERVED_PREFIX

#: Every wake name starts with this.
WAKE_PREFIX = RESERVED_PREFIX + "wake:"


class Waker(Protocol):
    """What carries a store's wake-ups: a driver's lock watch (see the module)."""

    async def watch(self, name: str, cursor: object = None) -> bool: ...

    async def unwatch(self, name: str) -> None: ...


def wake_name(lease_name: str) -> str:
    """The reserved name whose notifications wake the waiters of ``lease_name``."""
    return WAKE_PREFIX + lease_name


def woken_name(name: str) -> str:
    """The lease name whose waiters a wake-up of ``name`` is for: ``name`` itself, or the
    lease name of a :func:`wake_name`."""
    if name[:1] == "\x00" and name.startswith(WAKE_PREFIX):
        return name[len(WAKE_PREFIX) :]
    return name
