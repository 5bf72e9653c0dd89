"""``backend.holders(pattern, kinds=...)``: every held name matching a glob, as the
server sees it: its lock's holder, its semaphore's permits and its read-write lock's
holds (separate namespaces: one name may be all three)."""

from __future__ import annotations

from collections.abc import Collection
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, cast

from .holder import Holder
from .validation import RESERVED_PREFIX

if TYPE_CHECKING:
    from .acquisition import Acquisition

#: What :meth:`~asynclock.Backend.holders` can list (``Holder.kind``): a lock's holder; a
#: semaphore's permit; a read-write lock's writer, readers and waiting writers' intents.
LOCK = "lock"
HOLD_KINDS = ("permit", "write", "read", "intent")
KINDS = (LOCK, *HOLD_KINDS)
_RW = frozenset(HOLD_KINDS[1:])


def _literal_start(pattern: str) -> str:
    """The start of a glob before its first wildcard (``*``, ``?``, ``[``)."""
    for i, ch in enumerate(pattern):
        if ch in "*?[":
            return pattern[:i]
    return pattern


def check_kinds(kinds: object) -> frozenset[str]:
    """``kinds``: one kind (a str) or a collection of them, each one of :data:`KINDS`."""
    if isinstance(kinds, str):
        kinds = (kinds,)
    if not isinstance(kinds, Collection) or not kinds:
        raise TypeError(f"kinds must be a non-empty collection of {KINDS}, got {kinds!r}")
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"kinds may be any of {', '.join(KINDS)}; got {unknown!r}")
    return frozenset(cast("Collection[str]", kinds))


async def list_holders(
    acq: Acquisition, pattern: str, limit: int, kinds: object = (LOCK,)
) -> list[Holder]:
    """At most ``limit`` holders of ``kinds`` whose name matches ``pattern``, sorted by
    name; per name its lock's holder, then permits by slot, then the writer, readers and
    intents (checked)."""
    if not isinstance(pattern, str):
        raise TypeError(f"pattern must be a str glob such as 'invoice:*', got {pattern!r}")
    if type(limit) is not int or not 1 <= limit <= 100_000:
        raise ValueError(f"limit must be an int from 1 to 100000, got {limit!r}")
    wanted = check_kinds(kinds)
    driver = acq.driver
    locks: list[str] = []
    sems: list[str] = []
    rws: list[str] = []
    if LOCK in wanted:
        # Only the names the glob's literal start allows: a partition group's listing (a
        # balance every heartbeat) must not cost as much as every other name on the server.
        start = _literal_start(pattern)
        names = driver.names_under(start) if start else driver.names()
        locks = cast("list[str]", await acq.call("names", names, (NotImplementedError,)))
    if wanted - {LOCK}:
        listed = await acq.call("names", driver.hold_names(), (NotImplementedError,))
        sems, rws = cast("tuple[list[str], list[str]]", listed)

    def matching(names: list[str]) -> set[str]:
        # Not asynclock's own names (idempotency keys' locks: see backend.idempotent()).
        return {n for n in names if not n.startswith(RESERVED_PREFIX) and fnmatchcase(n, pattern)}

    lock_names = matching(locks)
    sem_names = matching(sems) if "permit" in wanted else set()
    rw_names = matching(rws) if wanted & _RW else set()
    found: list[Holder] = []
    for name in sorted(lock_names | sem_names | rw_names):
        here: list[Holder] = []
        if name in lock_names:
            held = await acq.call("holder", driver.holder(name), (NotImplementedError,))
            here += [] if held is None else [cast("Holder", held)]
        if name in sem_names:  # every live permit, whatever its limit (not checked)
            store = driver.semaphore_store(name, 1)
            permits = await acq.call("holders", store.holders(), (NotImplementedError,))
            here += cast("list[Holder]", permits)
        if name in rw_names:
            holds = await acq.call(
                "holders", driver.rwlock_store(name).holders(), (NotImplementedError,)
            )
            here += [h for h in cast("list[Holder]", holds) if h.kind in wanted]
        for held in here:
            found.append(held)
            if len(found) == limit:
                return found
    return found
