"""Semaphores and read-write locks on ``redis+sentinel://`` and ``redis+cluster://``: the
one-server scripts (:mod:`.semaphore`, :mod:`.rwlock`), each run on the primary that serves
the name, with the locks' rules for a primary that is replaced.

* **One slot.** Every key a grant touches carries the name's hash tag (``sem:{name}``,
  ``sem:{name}:h``, the wait queue's ``:q`` and ``:qx``; ``rw:{name}``, ``:r``, ``:i``),
  and the epoch key it takes is the epoch key of that slot (a cluster's
  ``epoch:{<slot tag>}``, :class:`~.topology.SlotKeyCache`; Sentinel's database epoch
  key): one slot, one primary, one atomic script. No call crosses slots.
* **One grant.** A grant goes again only when it did not run: ``MOVED``, ``TRYAGAIN``,
  ``CLUSTERDOWN``, ``READONLY`` and a connection that found a restarted server are answered
  before a script runs, and ADOPT (run first, :meth:`~.routed.Routed.before_grant`) refuses
  on a server that is not a primary. ``ASK`` (the slot half migrated) is "busy, ask again
  in 50 ms", as for locks, and is never followed for a grant. A grant whose answer is lost
  raises, and the core gives back whatever it may have granted (owner-checked, any slot).
  A grant from a primary retired meanwhile is lost with it: given back there and asked
  again of the successor.
* **Failover is a restart** (as for locks): every permit and hold the old primary granted is
  lost at once, before its successor grants, and the holders are cancelled
  (``LeaseLost``, the failover in the reason); the successor grants nothing for the restart
  grace (permits of the old primary may still be in use), and every token it hands out
  after is above the old primary's (the token floor of ADOPT, applied per slot and per
  epoch in the scripts). A restart of the primary (a new ``run_id``) does the same.
  A semaphore's wait queue (its places) is not carried over either when the new primary
  lacks it: only the waiters' order is lost (they take new places as they ask again).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from functools import cached_property, partial
from typing import TYPE_CHECKING, TypeVar

from ..._core.driver import Busy, ExtendResult, LeaseRef, Refused
from ..._core.exceptions import BackendUnavailable
from ..._core.holder import Holder
from ..._core.permit_store import Answer, Full, Granted, PermitStore
from ..._core.rw_store import READ, WRITE, Held, ModeGrants, RWAnswer, RWStore
from ..._core.rwlock import LEASE_PREFIX as RW_PREFIX
from ..._core.semaphore import LEASE_PREFIX as SEM_PREFIX
from .rwlock import RWCalls
from .semaphore import SemCalls

if TYPE_CHECKING:
    from .routed import PrimaryDriver, Routed

T = TypeVar("T")

#: How soon to ask again while the name's slot is being migrated (as a lock's ``ASK``).
MIGRATING = 0.05


class Routing:
    """What both stores share: the grant loop and which primary granted each hold."""

    def __init__(
        self,
        driver: Routed,
        name: str,
        lease_name: str,
        give_back: Callable[[PrimaryDriver, str], Awaitable[object]],
    ) -> None:
        self.driver = driver
        self.name = name
        self.lease_name = lease_name
        #: ``give_back(p, owner)``: free what ``p`` granted ``owner`` (owner-checked).
        self.give_back = give_back
        #: owner -> the primary of its last grant (the core's acquire reads it back).
        self.granted_on: dict[str, PrimaryDriver] = {}

    def epoch(self, p: PrimaryDriver) -> bytes:
        """The epoch key a grant of the name takes on ``p``: its slot's on a cluster."""
        return p.keys(self.name).acquire_keys[4]

    async def grant(
        self,
        owner: str,
        call: Callable[[PrimaryDriver], Awaitable[T]],
        granted: Callable[[T], bool],
    ) -> T | None:
        """``call(p)`` (one grant script) on the name's primary; None while its slot is
        being migrated. ``granted``: whether an answer is a grant (to give back if ``p``
        was retired while it was asked)."""
        driver = self.driver
        for attempt in range(driver.attempts):
            p = await driver.route(self.name)
            try:
                await driver.before_grant(p, self.name)
                answer = await call(p)
            except BackendUnavailable as exc:
                if attempt + 1 < driver.attempts and await driver.again(exc, p):
                    continue  # the script did not run there (see the module)
                if driver.migrating(exc):
                    return None
                raise
            if p.retired:
                if granted(answer):
                    driver.give_back(p, partial(self.give_back, p, owner))
                continue
            self.granted_on[owner] = p
            return answer
        raise BackendUnavailable(
            f"{driver.display}: a grant of {self.name!r}: the primary kept moving"
        )

    def held(self, owner: str) -> None:
        """The core took ``owner``'s grant: lost with the primary that granted it."""
        p = self.granted_on.pop(owner, None)
        if p is None:
            return
        self.driver.holds[owner] = (self.lease_name, p)
        p.adopted(self.lease_name, owner)  # lost at once if that server restarts

    def dropped(self, owner: str) -> PrimaryDriver | None:
        """``owner``'s hold ends here: the primary that granted it, if known."""
        self.granted_on.pop(owner, None)
        held = self.driver.holds.pop(owner, None)
        if held is None:
            return None
        held[1].forget(owner)
        return held[1]

    async def call(self, what: str, call: Callable[[PrimaryDriver], Awaitable[T]]) -> T:
        """``call(p)`` on the name's primary (again after MOVED; ASK followed)."""
        result: T = await self.driver._call(self.name, what, call)
        return result

    async def extend(
        self,
        leases: Sequence[LeaseRef],
        call: Callable[[PrimaryDriver, list[LeaseRef]], Awaitable[list[ExtendResult]]],
    ) -> list[ExtendResult]:
        """Renew ``leases`` on the name's primary (one script), except those granted by a
        primary since replaced: refused (lost, as locks are)."""
        holds = self.driver.holds
        results: list[ExtendResult | None] = [None] * len(leases)
        live: list[int] = []
        for i, ref in enumerate(leases):
            held = holds.get(ref.owner)
            if held is not None and held[1].retired:
                results[i] = Refused(f"{held[1].describe()} was replaced (failover)")
            else:
                live.append(i)
        if live:
            used: list[PrimaryDriver] = []

            async def on(p: PrimaryDriver) -> list[ExtendResult]:
                used.append(p)
                return await call(p, [leases[i] for i in live])

            answers = await self.call("renewal", on)
            p = used[-1]
            for i, result in zip(live, answers, strict=True):
                results[i] = result
                owner = leases[i].owner
                held = holds.get(owner)
                if held is None:
                    continue
                if isinstance(result, Refused):
                    self.dropped(owner)
                elif held[1] is not p:  # the slot migrated: held there from now on
                    held[1].forget(owner)
                    p.adopted(self.lease_name, owner)
                    holds[owner] = (self.lease_name, p)
        return [r if r is not None else BackendUnavailable("not renewed") for r in results]

    def lost_with_primary(self, owner: str) -> bool:
        """``owner``'s hold ends (released): True if it was lost with a replaced primary
        (then there is nothing to give back)."""
        p = self.dropped(owner)
        return p is not None and p.retired


class RoutedPermits(PermitStore):
    """A semaphore on the primary that serves its name (see the module)."""

    def __init__(self, driver: Routed, name: str, limit: int) -> None:
        super().__init__(name, limit)
        self.display = driver.display
        self.calls = SemCalls(name, limit, driver.prefix)
        self.routing = Routing(driver, name, SEM_PREFIX + name, self._give_back)
        self.waker = driver

    async def withdraw(self, owner: str) -> None:
        calls = self.calls
        await self.routing.call("withdraw", lambda p: calls.withdraw(p.node, owner))

    async def grant(self, owner: str, ttl: float, *, queue: bool = False) -> Answer:
        calls, routing = self.calls, self.routing

        async def on(p: PrimaryDriver) -> Answer:
            epoch, grace = routing.epoch(p), p.restart_grace
            return await calls.grant(p.node, epoch, grace, owner, ttl, queue)

        answer = await routing.grant(owner, on, lambda a: isinstance(a, Granted))
        return Full(MIGRATING) if answer is None else answer

    async def _give_back(self, p: PrimaryDriver, owner: str) -> None:
        await self.calls.release(p.node, owner, None, None)

    async def acquire(
        self, name: str, owner: str, ttl: float, *, queue: bool, scope: str | None = None
    ) -> int | Busy:
        result = await super().acquire(name, owner, ttl, queue=queue, scope=scope)
        if not isinstance(result, Busy):
            self.routing.held(owner)
        return result

    async def extend(self, leases: Sequence[LeaseRef]) -> Sequence[ExtendResult]:
        calls, slots = self.calls, self.slots

        async def on(p: PrimaryDriver, refs: list[LeaseRef]) -> list[ExtendResult]:
            return await calls.extend(p.node, slots, refs)

        return await self.routing.extend(leases, on)

    async def holders(self) -> list[Holder]:
        calls, name = self.calls, self.name
        return await self.routing.call("holders", lambda p: calls.holders(p.node, name))

    async def release_permit(self, owner: str, slot: int | None, token: int | None) -> bool:
        if self.routing.lost_with_primary(owner):
            return False  # lost with the primary that granted it
        calls = self.calls
        return await self.routing.call(
            "release", lambda p: calls.release(p.node, owner, slot, token)
        )


class _Mode(ModeGrants):
    """A mode of :class:`RoutedRW`: a grant the core takes is kept with its primary."""

    store: RoutedRW

    async def acquire(
        self, name: str, owner: str, ttl: float, *, queue: bool, scope: str | None = None
    ) -> int | Busy:
        result = await super().acquire(name, owner, ttl, queue=queue, scope=scope)
        if not isinstance(result, Busy):
            self.store.routing.held(owner)
        return result


class RoutedRW(RWStore):
    """A read-write lock on the primary that serves its name (see the module)."""

    def __init__(self, driver: Routed, name: str) -> None:
        super().__init__(name)
        self.display = driver.display
        self.calls = RWCalls(name, driver.prefix)
        self.routing = Routing(driver, name, RW_PREFIX + name, self._give_back)
        self.waker = driver

    @cached_property
    def reads(self) -> ModeGrants:
        return _Mode(self, READ)

    @cached_property
    def writes(self) -> ModeGrants:
        return _Mode(self, WRITE)

    async def grant(self, mode: str, owner: str, ttl: float, *, intend: bool) -> RWAnswer:
        calls, routing = self.calls, self.routing

        async def on(p: PrimaryDriver) -> RWAnswer:
            epoch, grace = routing.epoch(p), p.restart_grace
            return await calls.grant(p.node, epoch, grace, mode, owner, ttl, intend=intend)

        answer = await routing.grant(owner, on, lambda a: isinstance(a, int))
        if answer is None:
            return Held("its hash slot is being migrated", MIGRATING)
        return answer

    async def _give_back(self, p: PrimaryDriver, owner: str) -> None:
        for mode in (WRITE, READ):
            await self.calls.release(p.node, mode, owner, None)

    async def extend(self, mode: str, leases: Sequence[LeaseRef]) -> Sequence[ExtendResult]:
        calls = self.calls

        async def on(p: PrimaryDriver, refs: list[LeaseRef]) -> list[ExtendResult]:
            return await calls.extend(p.node, mode, refs)

        return await self.routing.extend(leases, on)

    async def release_hold(self, mode: str, owner: str, token: int | None) -> bool:
        if self.routing.lost_with_primary(owner):
            return False
        calls = self.calls
        return await self.routing.call(
            "release", lambda p: calls.release(p.node, mode, owner, token)
        )

    async def holders(self) -> list[Holder]:
        calls, name = self.calls, self.name
        return await self.routing.call("holders", lambda p: calls.holders(p.node, name))

    async def withdraw(self, owner: str) -> None:
        calls = self.calls
        await self.routing.call("withdraw", lambda p: calls.release(p.node, "i", owner, None))
