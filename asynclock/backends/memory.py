"""``memory://`` — locks inside one process. The reference implementation for tests.

Waiters are served first come, first served: a free name goes to the oldest queued waiter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from .._core.driver import Busy, Driver, ExtendResult, LeaseRef, Record, Refused
from .._core.holder import Holder
from .._core.permit_store import (
    Answer,
    Full,
    Granted,
    OtherLimit,
    PermitStore,
    permit_holder,
    place_ttl,
)
from .._core.rw_store import RWStore
from .._core.turns import Turns
from ._common.options import Options
from .memory_rw import MemoryRW, RWState


@dataclass(slots=True)
class _Entry:
    owner: str
    token: int
    expires_at: float


class MemoryDriver(Driver):
    """State lives in this object; share one backend to share locks between tasks."""

    display = "memory://"
    #: No server round trip: one call renews every lease.
    renew_chunk = None
    #: Every release wakes the head of the name's queue (``_wake_next``).
    wakes_waiters = True

    def __init__(self) -> None:
        super().__init__()
        self.leases: dict[str, _Entry] = {}
        self.counters: dict[str, int] = {}
        self.scope_counters: dict[str, int] = {}
        self.queues = Turns()
        #: Idempotency records: name -> (record, expiry on the clock).
        self.records: dict[str, tuple[Record, float]] = {}
        #: Semaphores: name -> slot -> the live permit (a namespace apart from the locks).
        self.permits: dict[str, dict[int, _Permit]] = {}
        #: (name, slot) -> the slot's last token (kept for ever: G2 per slot).
        self.slot_tokens: dict[tuple[str, int], int] = {}
        #: Semaphores' wait queues: name -> owner -> when its place lapses (arrival order:
        #: a dict keeps a key's position when its value is updated).
        self.places: dict[str, dict[str, float]] = {}
        #: Read-write locks: name -> its state (see .memory_rw; a namespace of its own).
        self.rwlocks: dict[str, RWState] = {}

    def semaphore_store(self, name: str, limit: int) -> PermitStore:
        return MemoryPermits(self, name, limit)

    def rwlock_store(self, name: str) -> RWStore:
        return MemoryRW(self, name)

    def _live(self, name: str) -> _Entry | None:
        entry = self.leases.get(name)
        if entry is not None and entry.expires_at <= self.clock.now():
            del self.leases[name]
            return None
        return entry

    async def acquire(
        self, name: str, owner: str, ttl: float, *, queue: bool, scope: str | None = None
    ) -> int | Busy:
        now = self.clock.now()
        entry = self._live(name)
        queues = self.queues
        if entry is None and not queues.behind(name, owner):
            if queues:
                queues.leave(name, owner)  # (the next one's turn comes at the release)
            token = self.counters.get(name, 0) + 1
            if scope is not None:
                # G2 for the scope and the name: above both counters, and both move up.
                token = max(token, self.scope_counters.get(scope, 0) + 1)
                self.scope_counters[scope] = token
            self.counters[name] = token
            self.leases[name] = _Entry(owner, token, now + ttl)
            return token
        if queue:
            queues.join(name, owner)
        if entry is None:
            return Busy()
        return Busy(retry_after=entry.expires_at - now, owner=entry.owner)

    async def extend(self, leases: Sequence[LeaseRef]) -> Sequence[ExtendResult]:
        now = self.clock.now()
        results: list[ExtendResult] = []
        for ref in leases:
            entry = self._live(ref.name)
            if entry is None or entry.owner != ref.owner or entry.token != ref.token:
                results.append(Refused("not held by this owner"))
            else:
                entry.expires_at = now + ref.ttl
                results.append(True)
        return results

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        entry = self._live(name)
        if entry is None or entry.owner != owner or (token is not None and entry.token != token):
            return False
        del self.leases[name]
        if self.queues:  # (_wake_next, inline: nobody waits on most releases)
            self._wake_next(name)
        return True

    def _wake_next(self, name: str) -> None:
        """The name is free: wake the head of its queue only (no herd). Every waiter of
        this backend is queued (a blocking acquire joins the queue), so no queue: none."""
        head = self.queues.head(name)
        if head is not None:
            self._wake(name, head)

    async def validate(self, name: str, token: int) -> bool:
        entry = self._live(name)
        return entry is not None and entry.token == token

    async def abandon(self, name: str, owner: str) -> None:
        head = self.queues.leave(name, owner)
        if head is not None:
            self._wake(name, head)  # the head left: the next one's turn

    async def names(self) -> list[str]:
        return list(self.leases)

    async def hold_names(self) -> tuple[list[str], list[str]]:
        return [n for n, live in self.permits.items() if live], list(self.rwlocks)

    async def holder(self, name: str) -> Holder | None:
        entry = self._live(name)
        if entry is None:
            return None
        return Holder(name, entry.owner, entry.token, max(0.0, entry.expires_at - self.clock.now()))

    async def break_lock(self, name: str) -> bool:
        # The counter stays (G2); the broken owner's next extend finds no entry (refused).
        if self._live(name) is None:
            return False
        del self.leases[name]
        self._wake_next(name)
        return True

    # -- idempotency records: beside the leases, checked against them in one step (no await)

    async def record_get(self, name: str) -> Record | None:
        found = self.records.get(name)
        if found is None:
            return None
        if found[1] <= self.clock.now():
            del self.records[name]
            return None
        return found[0]

    async def record_put(
        self, name: str, owner: str, token: int, payload: str, keep: float
    ) -> bool:
        entry = self._live(name)
        if entry is None or entry.owner != owner or entry.token != token:
            return False
        self.records[name] = (Record(token, payload), self.clock.now() + keep)
        return True

    async def record_delete(self, name: str, token: int) -> bool:
        found = self.records.get(name)
        if found is None or found[0].token != token:
            return False
        del self.records[name]
        return True


@dataclass(slots=True)
class _Permit:
    owner: str
    token: int
    expires_at: float
    limit: int


class MemoryPermits(PermitStore):
    """A semaphore's permits in the driver's dicts (every step runs without an await)."""

    renew_chunk = None
    display = "memory://"

    def __init__(self, driver: MemoryDriver, name: str, limit: int) -> None:
        super().__init__(name, limit)
        self.driver = driver

    def _live(self) -> dict[int, _Permit]:
        now = self.driver.clock.now()
        slots = self.driver.permits.setdefault(self.name, {})
        for slot in [s for s, p in slots.items() if p.expires_at <= now]:
            del slots[slot]
        return slots

    def _places(self) -> dict[str, float]:
        now = self.driver.clock.now()
        places = self.driver.places.setdefault(self.name, {})
        for owner in [o for o, t in places.items() if t <= now]:
            del places[owner]
        return places

    async def grant(self, owner: str, ttl: float, *, queue: bool = False) -> Answer:
        slots, places = self._live(), self._places()
        if slots:
            held = next(iter(slots.values())).limit
            if held != self.limit:
                return OtherLimit(held)
        now = self.driver.clock.now()
        ahead = list(places).index(owner) if owner in places else len(places)
        if len(slots) + ahead >= self.limit:
            if queue:
                places[owner] = now + place_ttl(ttl)
            if len(slots) < self.limit:
                return Full()  # free, but for waiters ahead of us
            return Full(min(p.expires_at for p in slots.values()) - now)
        places.pop(owner, None)
        slot = next(s for s in range(self.limit) if s not in slots)
        key = (self.name, slot)
        token = self.driver.slot_tokens[key] = self.driver.slot_tokens.get(key, 0) + 1
        slots[slot] = _Permit(owner, token, self.driver.clock.now() + ttl, self.limit)
        return Granted(slot, token)

    async def withdraw(self, owner: str) -> None:
        self._places().pop(owner, None)

    async def holders(self) -> list[Holder]:
        now = self.driver.clock.now()
        return [
            permit_holder(self.name, s, p.owner, p.token, p.expires_at - now, p.limit)
            for s, p in sorted(self._live().items())
        ]

    def _find(self, owner: str, token: int | None) -> int | None:
        for slot, permit in self._live().items():
            if permit.owner == owner and (token is None or permit.token == token):
                return slot
        return None

    async def extend(self, leases: Sequence[LeaseRef]) -> Sequence[ExtendResult]:
        now = self.driver.clock.now()
        results: list[ExtendResult] = []
        for ref in leases:
            slot = self._find(ref.owner, ref.token)
            if slot is None:
                results.append(Refused("the permit is gone (expired or taken over)"))
            else:
                self.driver.permits[self.name][slot].expires_at = now + ref.ttl
                results.append(True)
        return results

    async def release_permit(self, owner: str, slot: int | None, token: int | None) -> bool:
        found = self._find(owner, token)
        if found is None:
            return False
        del self.driver.permits[self.name][found]
        return True


def driver_from_url(url: str, **options: Any) -> MemoryDriver:
    parts = urlsplit(url)
    if parts.netloc or parts.path.strip("/") or parts.query or parts.fragment:
        raise ValueError(
            f"memory:// takes no host, path or query options: use exactly 'memory://', got {url!r}"
        )
    Options("memory", (), ()).check((), options)
    return MemoryDriver()
