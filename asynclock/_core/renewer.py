"""The renewer, the watchdog and the loss of a lease (one of each per backend).

* one renewer per backend (so per event loop) extends *all* held leases in one driver
  call per heartbeat and reports loss per lease (G7, see docs/concepts.md);
* a watchdog cancels a holder whose local deadline or ``max_hold`` passes (G4);
* ``lease.extend(ttl)`` requests ride the renewer's next round; ``let_expire`` extends
  once more and stops renewing.

:class:`Renewer` is a part of :class:`~asynclock._core.backend.Backend` (a mixin over its
state); it is not used on its own.
"""

from __future__ import annotations

import logging
import math
import random
import re
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

import anyio

from .bounds import shielded_call
from .driver import LeaseRef, Refused
from .exceptions import BackendUnavailable, LeaseLost
from .lease import Lease
from .validation import check_lease_ttl

if TYPE_CHECKING:
    import weakref

    from .bounds import CallBounds
    from .clock import Clock
    from .driver import Driver
    from .stats import StatsRecorder

logger = logging.getLogger("asynclock")

#: How long the idle renewer and watchdog sleep before looking again (no leases held).
IDLE_NAP = 1.0


class Renewer:
    """The background half of a :class:`Backend`: renewal, the watchdog, loss, extend."""

    # The backend's state the renewer reads and writes (set in Backend.__init__).
    driver: Driver
    clock: Clock
    drift: float
    margin: float
    heartbeat: float
    _held: dict[str, _Held]
    _dropped: list[weakref.ref[Lease]]
    _bounds: CallBounds
    _stats: StatsRecorder
    _renew_wake: anyio.CancelScope | None
    _watch_wake: anyio.CancelScope | None
    _next_round: float
    _renew_asap: bool
    _watch_until: float
    _round_done: anyio.Event
    _extends: dict[str, _ExtendRequest]

    if TYPE_CHECKING:

        @property
        def release_timeout(self) -> float: ...
        def _check_loop(self) -> None: ...
        def _live(self) -> list[Lease]: ...
        def _wake_waiters(self, name: str) -> None: ...

    async def _renewal_round(self) -> None:
        """Wait until the renewer finishes its next round trip (for tests and tools)."""
        await self._round_done.wait()

    async def _let_expire(self, lease: Lease) -> bool:
        """Extend ``lease`` once more (owner-checked, G5), then stop renewing it."""
        self._check_loop()
        entry = self._held.get(lease.owner)
        if entry is None or entry[0]() is not lease or lease._released:
            return False
        ref = LeaseRef(lease.name, lease.owner, lease.token, lease.ttl)
        result: object = None
        try:
            results = await shielded_call(self.driver.extend([ref]), self._bounds)
            result = None if results is None else results[0]
        except Exception as exc:
            result = exc
        if isinstance(result, Refused):
            self._lose(lease, f"renewal refused: {result.reason}")
            return False
        # Stop renewing; from here on only the server's ttl keeps the name taken.
        self._held.pop(lease.owner, None)
        lease._released = True
        self._stats.released += 1
        return result is True

    # -- loss ------------------------------------------------------------------------------

    def _lost_out_of_band(self, name: str, owner: str, reason: str) -> None:
        entry = self._held.get(owner)
        lease = None if entry is None else entry[0]()
        if lease is not None and lease.name == name:
            self._lose(lease, reason)

    def _lose(self, lease: Lease, reason: str) -> None:
        """Mark ``lease`` lost (once), stop renewing it and cancel its holder (G4)."""
        self._held.pop(lease.owner, None)
        if self._extends:
            self._end_extend(lease, Refused(reason))
        if lease.lost:
            return
        lease.lost._set(reason)
        self._count_loss(lease, reason)
        if lease._scope is not None:
            lease._scope.cancel()

    def _count_loss(self, lease: Lease, reason: str) -> None:
        self._stats.losses += 1
        self._stats.loss_reasons[re.split(r"[:;(]", reason, maxsplit=1)[0].strip()] += 1
        logger.warning("lease lost: %r token=%d: %s", lease.name, lease.token, reason)

    def _renew_soon(self) -> None:
        """The driver's ``renew_now``: renew every held lease now, not at the next heartbeat
        (a connection came back; the server may have restarted and lost them)."""
        self._renew_asap = True
        if self._held:
            self._next_round = self.clock.now()
            _poke(self._renew_wake)

    # -- background loops ------------------------------------------------------------------

    async def _renew_loop(self) -> None:
        failures = 0
        idle = IDLE_NAP
        while True:
            if not self._held and self._next_round <= self.clock.now():
                # Nap instead of parking at infinity: a grant within the nap then needs no
                # wake-up call (tight acquire/release loops stay cheap).
                self._next_round = self.clock.now() + idle
            await self._sleep_until(self._next_round, "_renew_wake")
            if self._dropped:
                await self._reap_dropped()
                if not self._held:  # nothing left to renew: this was the round
                    self._round_done.set()
                    self._round_done = anyio.Event()
            if not self._held:
                continue
            now = self.clock.now()
            if now < self._next_round:
                continue
            batch = self._live()
            if not batch:
                continue
            period = min(lease.ttl for lease in batch) * self.heartbeat
            idle = min(period, IDLE_NAP)
            refs = [LeaseRef(lease.name, lease.owner, lease.token, lease.ttl) for lease in batch]
            # lease.extend(ttl) requests ride this round with their new ttl (one renewer:
            # rounds never overlap, so the server's expiry is the last one we sent).
            asked = self._extends_for(refs) if self._extends else None
            t_send = self.clock.now()
            self._renew_asap = False
            results: list[object]
            try:
                with anyio.fail_after(max(period, 0.01)):
                    results = list(await self.driver.extend(refs))
                if len(results) != len(refs):
                    raise RuntimeError(f"driver returned {len(results)} results for {len(refs)}")
            except Exception as exc:
                results = [exc] * len(refs)
            self._stats.renewal_round_trips += 1
            errors = 0
            for lease, ref, result in zip(batch, refs, results, strict=True):
                request = asked.get(lease.owner) if asked else None
                entry = self._held.get(lease.owner)
                if entry is None or entry[0]() is not lease:
                    if request is not None:
                        self._end_extend(lease, Refused(lease.lost.reason or "released"), request)
                    continue  # released or lost while we were asking
                if request is not None:
                    self._extended(lease, ref, result, t_send)
                    self._end_extend(lease, result, request)
                    continue
                if result is True:
                    deadline = t_send + lease.ttl * (1 - self.drift) - self.margin
                    if deadline > lease._deadline:
                        lease._deadline = deadline
                    self._stats.renewals += 1
                elif isinstance(result, Refused):
                    self._lose(lease, f"renewal refused: {result.reason}")
                else:
                    errors += 1
                    logger.debug("renewal of %r failed, will retry: %r", lease.name, result)
            self._round_done.set()
            self._round_done = anyio.Event()
            if errors:
                self._stats.renewal_errors += errors
                failures += 1
                backoff = min(period, 0.02 * 2 ** min(failures, 10)) * (0.5 + random.random() / 2)
                self._next_round = self.clock.now() + backoff
            else:
                failures = 0
                self._next_round = t_send + period
            if asked is not None or self._extends:
                # A ttl changed (the period with it), or an extend waits for a round.
                self._next_round = self._after_extends(t_send, errors > 0)
            if self._renew_asap:  # asked during this round: its answers may predate it
                self._next_round = self.clock.now()

    async def _watchdog_loop(self) -> None:
        while True:
            now = self.clock.now()
            earliest = min((lease.deadline for lease in self._live()), default=now + IDLE_NAP)
            if now < earliest:
                self._watch_until = earliest
                await self._sleep_until(earliest, "_watch_wake")
                self._watch_until = -math.inf
                continue
            for lease in self._live():
                if now >= lease.deadline:
                    self._lose(lease, _deadline_reason(lease, now))

    async def _reap_dropped(self) -> None:
        """Release the leases that were garbage-collected unreleased (nobody can use them,
        so nobody may keep the name), and say so like an unclosed file's ResourceWarning."""
        while self._dropped:  # drain first: a lease collected from now on flags again
            self._dropped.pop()
        for owner, entry in list(self._held.items()):
            if entry[0]() is not None or self._held.get(owner) is not entry:
                continue  # alive, or released while we were releasing another one
            del self._held[owner]
            _, name, token = entry
            logger.warning(
                "lease on %r (token %d) was garbage-collected without release(): releasing "
                "it; call `await lease.release()`, or hold it with `async with "
                "backend.lock(...)`",
                name,
                token,
            )
            await self._shielded(self.driver.release(name, owner, token), "release dropped")
            self._wake_waiters(name)

    async def _sleep_until(self, when: float, slot: str) -> None:
        with anyio.CancelScope() as scope:
            setattr(self, slot, scope)
            if when == math.inf:
                await anyio.sleep_forever()
            else:
                await self.clock.sleep_until(when)
        setattr(self, slot, None)

    async def _shielded(self, call: Awaitable[Any], what: str) -> None:
        """A clean-up call, shielded and bounded like a release; failures are logged."""

        async def run() -> bool:
            await call
            return True

        try:
            done = await shielded_call(run(), self._bounds)
        except Exception as exc:
            logger.debug("%s failed: %r", what, exc)
            return
        if done is None:
            logger.warning("%s timed out after %gs", what, self.release_timeout)

    async def _extend_lease(self, lease: Lease, ttl: object) -> None:
        """``lease.extend(ttl)``: the renewer's next round, now, carries the new ttl."""
        self._check_loop()
        new_ttl = check_lease_ttl(ttl)
        if new_ttl * (1 - self.drift) - self.margin <= 0:
            raise ValueError(
                f"ttl={new_ttl:g}s leaves no time after drift ({self.drift:.0%}) and margin "
                f"({self.margin:g}s); use a ttl of at least {2 * self.margin + 0.001:g}s"
            )
        while True:
            lease.check()  # lost, released or past its deadline: LeaseLost, before any I/O
            entry = self._held.get(lease.owner)
            if entry is None or entry[0]() is not lease:
                raise LeaseLost(lease.name, lease.token, "no longer renewed by this backend")
            pending = self._extends.get(lease.owner)
            if pending is None:
                break
            await pending.done.wait()  # one ttl change at a time, in call order
        request = self._extends[lease.owner] = _ExtendRequest(new_ttl)
        self._next_round = self.clock.now()
        _poke(self._renew_wake)
        try:
            await request.done.wait()
        finally:
            if self._extends.get(lease.owner) is request:
                del self._extends[lease.owner]  # cancelled before the renewer sent it
            request.done.set()  # an extend queued behind this one may go now
        result = request.result
        if result is True:
            return
        if lease.lost.reason is not None:
            raise LeaseLost(lease.name, lease.token, lease.lost.reason)
        if isinstance(result, Refused):
            raise LeaseLost(lease.name, lease.token, result.reason)
        raise BackendUnavailable(
            f"{self.driver.display}: extend of {lease.name!r} to ttl={new_ttl:g}s failed "
            f"(the lease keeps renewing with ttl={lease.ttl:g}s): {result!r}"
        ) from (result if isinstance(result, BaseException) else None)

    def _extends_for(self, refs: list[LeaseRef]) -> dict[str, _ExtendRequest]:
        """The extend requests this round sends; their refs get the new ttl (in place)."""
        asked: dict[str, _ExtendRequest] = {}
        for i, ref in enumerate(refs):
            request = self._extends.get(ref.owner)
            if request is not None and not request.sent:
                request.sent = True
                asked[ref.owner] = request
                refs[i] = LeaseRef(ref.name, ref.owner, ref.token, request.ttl)
        return asked

    def _extended(self, lease: Lease, ref: LeaseRef, result: object, t_send: float) -> None:
        """Apply the answer to ``lease.extend(ref.ttl)`` sent at ``t_send`` (G3, G4)."""
        deadline = t_send + ref.ttl * (1 - self.drift) - self.margin
        if result is True:
            lease.ttl = ref.ttl
            lease._deadline = deadline  # may move earlier: a shorter ttl
            self._stats.renewals += 1
        elif isinstance(result, Refused):
            self._lose(lease, f"extend refused: {result.reason}")
            return
        elif deadline < lease._deadline:
            # Unknown whether the server took the shorter ttl: assume it did.
            lease._deadline = deadline
        else:
            return
        if lease.deadline < self._watch_until:
            _poke(self._watch_wake)

    def _end_extend(
        self, lease: Lease, result: object, request: _ExtendRequest | None = None
    ) -> None:
        """Answer ``request`` (default: the lease's pending one) with ``result``."""
        pending = self._extends.get(lease.owner)
        if request is None:
            request = pending
        if request is None:
            return
        if pending is request:
            del self._extends[lease.owner]
        request.result = result
        request.done.set()

    def _after_extends(self, t_send: float, backing_off: bool) -> float:
        """When the next round runs after one that changed a ttl or left a request."""
        if any(not request.sent for request in self._extends.values()):
            return self.clock.now()
        live = self._live()
        if not live:
            return self._next_round
        # The period of the ttls now held (this round's was computed from the old ones).
        shortest = min(lease.ttl for lease in live) * self.heartbeat
        if backing_off:
            return min(self._next_round, t_send + shortest)
        return t_send + shortest


class _ExtendRequest:
    """One ``lease.extend(ttl)`` waiting for the renewer's answer."""

    __slots__ = ("done", "result", "sent", "ttl")

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self.sent = False
        self.result: object = None
        self.done = anyio.Event()


def _deadline_reason(lease: Lease, now: float) -> str:
    hard = lease.hard_deadline is not None and now >= lease.hard_deadline
    return "max_hold reached" if hard else "local deadline passed"


def _poke(scope: anyio.CancelScope | None) -> None:
    if scope is not None:
        scope.cancel()


#: What the backend keeps per held lease: a weak reference (the holder keeps the Lease
#: alive), and the name and token to release it with once it is collected.
_Held = tuple["weakref.ref[Lease]", str, int]
