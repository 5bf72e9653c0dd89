"""``backend.holders(pattern)``: every held name matching a glob, as the server sees it."""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, cast

from .holder import Holder
from .validation import RESERVED_PREFIX

if TYPE_CHECKING:
    from .acquisition import Acquisition


async def list_holders(acq: Acquisition, pattern: str, limit: int) -> list[Holder]:
    """At most ``limit`` holders whose name matches ``pattern``, sorted by name (checked)."""
    if not isinstance(pattern, str):
        raise TypeError(f"pattern must be a str glob such as 'invoice:*', got {pattern!r}")
    if type(limit) is not int or not 1 <= limit <= 100_000:
        raise ValueError(f"limit must be an int from 1 to 100000, got {limit!r}")
    driver = acq.driver
    names = await acq.call("names", driver.names(), (NotImplementedError,))
    found: list[Holder] = []
    # Not asynclock's own names (idempotency keys' locks: see backend.idempotent()).
    listed = (n for n in cast("list[str]", names) if not n.startswith(RESERVED_PREFIX))
    for name in sorted(n for n in listed if fnmatchcase(n, pattern)):
        held = await acq.call("holder", driver.holder(name), (NotImplementedError,))
        if held is not None:
            found.append(cast("Holder", held))
            if len(found) == limit:
                break
    return found
