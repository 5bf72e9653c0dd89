"""What a busy answer to an acquisition raises: ``LockHeld`` (or ``RestartGrace``) for
``blocking=False``, and what ``AcquireTimeout`` says of the last one."""

from __future__ import annotations

from .driver import Busy
from .exceptions import LockHeld, RestartGrace
from .owner_label import label_of


def busy_error(name: str, busy: Busy) -> LockHeld:
    """What a busy answer raises for ``blocking=False``."""
    if busy.grace_until is not None:
        return RestartGrace(name, busy.retry_after or 0.0, busy.grace_until, busy.detail)
    return LockHeld(name, busy.retry_after, busy.detail, label_of(busy.owner))


def timeout_detail(name: str, busy: Busy) -> str | None:
    """What :class:`AcquireTimeout` says of the last busy answer: only a restart grace is
    worth saying (a busy name is what a timeout means anyway)."""
    if busy.grace_until is None:
        return None
    message = str(busy_error(name, busy))
    return "the backend was in its restart grace; " + message.split(", the end of ", 1)[0]
