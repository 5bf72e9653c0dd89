"""Clear errors for an async-only object used the sync way.

``with backend.lock(...)`` (a forgotten ``async``) is otherwise Python's bare "'Lock' object
does not support the context manager protocol", and ``for term in backend.leadership(...)``
"'Leadership' object is not iterable": neither says what to write instead.

The methods exist at run time only: type checkers do not see them, so they still flag the
misuse before it runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar


class AsyncContextOnly:
    """Mixin: ``with obj:`` raises a TypeError that says ``async with``."""

    __slots__ = ()

    #: How users get the object, for the message (``backend.lock(...)``).
    _usage: ClassVar[str]

    if not TYPE_CHECKING:

        def __enter__(self):
            raise TypeError(
                f"{self._usage} is an async context manager: write `async with "
                f"{self._usage}` (inside an `async def`), not `with`"
            )

        def __exit__(self, *exc_info):  # pragma: no cover - __enter__ always raises
            return None


def refuse_sync_iteration(usage: str) -> TypeError:
    """The error for ``for x in obj`` where ``obj`` is only async-iterable."""
    return TypeError(
        f"{usage} is an async iterator: write `async for term in {usage}` (inside an "
        "`async def`), not `for`"
    )
