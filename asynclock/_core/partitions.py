"""Partitions: a fleet of members shares a group's ``count`` partitions by lease.

One protocol over the lock primitives every backend has (docs/partitions.md):

* **membership** — a member holds the lock ``<group>/member/<member id>`` (uuid4 hex) for
  as long as it is in the group; the live members are ``holders("<group>/member/*")``.
* **partition** ``i`` is the lock ``<group>/partition/<i>``, owner-tagged with the member
  id (as a leadership term is with its identity). It is a lock, so it has every guarantee
  of one: its token (the partition token) is larger than every earlier owner's (G2 per
  name); its lease is renewed in the backend's one renewal batch; its loss cancels the
  consume running under it, as a lock's body, before any other member can be granted it
  (G3, G4: the consume runs in the lease's holder scope).
* **balance** — every renewal interval (``ttl * heartbeat``) and at once after a loss, a
  member lists the members and computes its quota (:func:`.partition_rules.quota`).
  Above it, it hands over its highest ids (consume cancelled and finished, then the lock
  released); below it, it tries the partitions it lacks with ``blocking=False``, from an
  offset of its own. Sticky: a member keeps what it owns within its quota, so a join or a
  leave moves about the minimum. A dead member's locks expire within their ttl.
"""

from __future__ import annotations

import itertools
import logging
import random
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc

from .context import LEASES, ExcInfo, enter_body, leave_body
from .exceptions import AsynclockError, LeaseLost, LockHeld
from .leadership import identity_of, owner_tag
from .lease import LossSignal
from .listing import list_holders
from .misuse import AsyncContextOnly
from .partition_rules import (
    MAX_PARTITIONS,
    MEMBER_PART,
    PARTITION_PART,
    check_partition_args,
    glob_escape,
    is_member_id,
    member_name,
    partition_name,
    partition_of,
    quota,
)

if TYPE_CHECKING:
    from .acquisition import Acquisition
    from .holder import Holder
    from .lease import Lease

logger = logging.getLogger("asynclock.partitions")

#: The most partitions one member tries to take at once in a balance round.
TAKE_AT_ONCE = 64


class Partition:
    """One partition owned by this member, for one grant (a later grant is a new object).

    ``id`` is its number (``0 .. count-1``), ``lease`` its lock's lease and ``token`` the
    fencing token of every write made for its keys: larger than any earlier owner's.
    ``lost`` is set (with a reason) once this member no longer owns it: lost like a lock,
    handed over to balance the group, or left with the group.
    """

    __slots__ = ("_consuming", "_done", "_ended", "id", "lease")
    #: What it says of itself in ``AlreadyHeld`` (``context.refuse_nested``).
    kind = "partition"

    def __init__(self, partition: int, lease: Lease) -> None:
        self.id = partition
        self.lease = lease
        self._ended = LossSignal()
        #: The consume's holder scope while it runs; ``_done`` set once it has finished.
        self._consuming: anyio.CancelScope | None = None
        self._done = anyio.Event()

    @property
    def token(self) -> int:
        return self.lease.token

    @property
    def lost(self) -> LossSignal:
        """Set when this member no longer owns the partition (``await`` it, or ``bool()``)."""
        return self.lease.lost if self.lease.lost else self._ended

    def __repr__(self) -> str:
        state = f"lost ({self.lost.reason})" if self.lost else "owned"
        return f"<Partition {self.id} token={self.token} {state}>"


@dataclass(frozen=True, slots=True)
class PartitionOwner:
    """Who owns a partition now, as the server sees it (a snapshot for routing and
    operators, not a permission: fence with the partition token)."""

    partition: int
    #: The owning member's id, or None if the lock is not held by a member.
    member: str | None
    #: The owning process's owner label (``host:pid`` by default).
    label: str | None
    token: int | None


def _owner(partition: int, found: Holder) -> PartitionOwner:
    member = identity_of(found.owner) if found.owner else None
    return PartitionOwner(partition, member, found.label, found.token)


class PartitionMember:
    """This process's place in a group: see :meth:`Backend.partitions`."""

    def __init__(self, acq: Acquisition, group: str, count: int, ttl: float) -> None:
        self._acq = acq
        self.group, self.count, self.ttl = group, count, ttl
        #: This member's id (uuid4 hex), in its member lock's name and in its owner tags.
        self.id = uuid.uuid4().hex
        self._tag = owner_tag(self.id)
        self._owned: dict[int, Partition] = {}
        self._version = 0
        self._changed = anyio.Event()
        self._wake = anyio.Event()
        #: Lost partitions whose hand-over the balance loop starts (see _on_lost).
        self._lost: list[Partition] = []
        self._member: Lease | None = None
        self._members: list[str] = []
        self._tg: anyio.abc.TaskGroup | None = None
        self._running = False
        self._closed = False

    def __repr__(self) -> str:
        return (
            f"<PartitionMember {self.group!r} id={self.id[:8]} owns {len(self._owned)} "
            f"of {self.count}>"
        )

    # -- what users call -----------------------------------------------------------------

    def partition_of(self, key: str | bytes) -> int:
        """The partition of ``key`` (see :func:`.partition_rules.partition_of`)."""
        return partition_of(key, self.count)

    def owned(self) -> list[Partition]:
        """The partitions this member owns now, by id."""
        return [self._owned[i] for i in sorted(self._owned)]

    async def changes(self) -> AsyncIterator[frozenset[int]]:
        """The ids this member owns: now, then after every change (changes that happen
        while the loop body runs are coalesced into the next item)."""
        seen = -1
        while True:
            if self._version != seen:
                seen = self._version
                yield frozenset(self._owned)
            else:
                await self._changed.wait()

    async def run(self, consume: Callable[[Partition], Awaitable[Any]]) -> None:
        """Run ``await consume(partition)`` for each partition this member owns (now and
        as it gets more), each in its own task and cancel scope, until cancelled.

        A partition lost or handed over has its consume cancelled, and finished, before
        its lock is released (another member cannot be granted it sooner). A consume that
        returns keeps its partition owned, without another consume, until it is handed
        over. A consume that raises while its partition is owned stops ``run()``: the
        other consumes are cancelled and the error propagates (leaving the ``async with``
        then leaves the group). An error raised after its partition was lost or handed
        over is logged and dropped: the partition is gone, and its owner's writes fenced.
        """
        if not callable(consume):
            raise TypeError(f"consume must be an async function, not {type(consume).__name__}")
        if self._closed:
            raise RuntimeError("this member has left its group")
        if self._running:
            raise RuntimeError("run() is running already for this member; call it once")
        self._running = True
        failure: list[BaseException] = []
        try:
            async with anyio.create_task_group() as tg:

                def fail(exc: BaseException) -> None:
                    if not failure:
                        failure.append(exc)
                    tg.cancel_scope.cancel()

                started: dict[int, Partition] = {}
                while True:
                    changed = self._changed
                    started = {i: p for i, p in started.items() if self._owned.get(i) is p}
                    for partition in self.owned():
                        if started.get(partition.id) is not partition:
                            started[partition.id] = partition
                            name = f"asynclock partition {self.group}/{partition.id}"
                            tg.start_soon(self._consume, partition, consume, fail, name=name)
                    await changed.wait()
        finally:
            self._running = False
        if failure:
            raise failure[0]

    async def members(self) -> list[str]:
        """The ids of the group's live members, as the server lists them: the holders of
        ``<group>/member/<id>`` whose owner tag is that member id. Another lock in that
        namespace (a plain lock, a nested group's) is no member: it must not skew quotas."""
        prefix = self.group + MEMBER_PART
        found = await list_holders(self._acq, glob_escape(prefix) + "*", 100_000)
        ids = (
            (h.name[len(prefix) :], identity_of(h.owner) if h.owner is not None else None)
            for h in found
        )
        return sorted(member for member, tagged in ids if is_member_id(member) and tagged == member)

    async def holders(self) -> list[PartitionOwner]:
        """Every owned partition of the group, as the server sees it, by partition."""
        found = await list_holders(
            self._acq, glob_escape(self.group + PARTITION_PART) + "*", MAX_PARTITIONS
        )
        owners = []
        for holder in found:  # exactly <group>/partition/<i>: not a nested group's locks
            number = holder.name[len(self.group + PARTITION_PART) :]
            exact = number.isascii() and number.isdecimal() and int(number) < self.count
            if exact and holder.name == partition_name(self.group, int(number)):
                owners.append(_owner(int(number), holder))
        return sorted(owners, key=lambda o: o.partition)

    async def owner_of(self, key: str | bytes) -> PartitionOwner | None:
        """Who owns ``key``'s partition now, or None if nobody does (for routing)."""
        number = self.partition_of(key)
        acq = self._acq.ready()
        call = acq.driver.holder(partition_name(self.group, number))
        found: Holder | None = await acq.call("holder", call, (NotImplementedError,))  # type: ignore[assignment]
        return None if found is None else _owner(number, found)

    # -- joining, balancing, leaving ------------------------------------------------------

    async def _join(self) -> None:
        self._acq.ready()
        await self.members()  # NotImplementedError now where the server cannot list names
        await self._rejoin()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        try:
            await self._balance()  # the free partitions now, not a heartbeat later
        except BaseException:
            await self._leave()
            raise
        self._tg.start_soon(self._balance_loop, name=f"asynclock partitions {self.group}")

    async def _leave(self) -> None:
        self._closed = True
        tg, self._tg = self._tg, None
        try:
            if tg is not None:  # the balancer stops (its hand-overs finish: shielded)
                tg.cancel_scope.cancel()
                await tg.__aexit__(None, None, None)
        finally:
            with anyio.CancelScope(shield=True):
                async with anyio.create_task_group() as leaving:
                    for partition in list(self._owned.values()):
                        leaving.start_soon(self._hand_over, partition, "left the group")
                    lost, self._lost = self._lost, []
                    for partition in lost:
                        leaving.start_soon(self._hand_over, partition, "lost")
                if self._member is not None:
                    await self._acq.release(self._member, quiet=True)

    async def _rejoin(self) -> None:
        member = self._member
        if member is not None and not member.lost and not member.released:
            return
        name = member_name(self.group, self.id)
        try:
            self._member = await self._acq.acquire(name, self.ttl, None, False, None, self._tag)
        except LockHeld:  # our lost lease, not yet expired at the server: next round
            self._member = None

    async def _balance_loop(self) -> None:
        interval = self.ttl * self._acq.session.heartbeat
        while True:
            with anyio.move_on_after(interval * random.uniform(0.8, 1.0)):
                await self._wake.wait()
            self._wake = anyio.Event()
            lost, self._lost = self._lost, []
            for partition in lost:
                if self._tg is not None:
                    self._tg.start_soon(self._hand_over, partition, "lost")
            try:
                await self._rejoin()
                await self._balance()
            except AsynclockError as exc:  # unavailable, restart grace: next round
                logger.warning("partitions %r: balancing failed, retrying: %r", self.group, exc)

    async def _balance(self) -> None:
        members = await self.members()
        self._members = members
        mine = quota(self.count, members, self.id)
        excess = len(self._owned) - mine
        if excess > 0:
            for number in sorted(self._owned, reverse=True)[:excess]:
                partition = self._owned.pop(number)
                self._notify()
                assert self._tg is not None
                self._tg.start_soon(self._hand_over, partition, "handed over")
            return
        if excess == 0:
            return
        # The partitions free as the server lists them, from an offset of this member's
        # own (members below quota start apart), tried at once, as many at a time as
        # are missing: the balance takes about one round trip, not one per partition.
        ranked = sorted(set(members) | {self.id})
        start = ranked.index(self.id) * self.count // len(ranked)
        held = {owner.partition for owner in await self.holders()}
        order = ((start + step) % self.count for step in range(self.count))
        free = iter([n for n in order if n not in self._owned and n not in held])
        while (missing := mine - len(self._owned)) > 0:
            batch = list(itertools.islice(free, min(missing, TAKE_AT_ONCE)))
            if not batch:
                return
            errors: list[Exception] = []
            async with anyio.create_task_group() as tg:
                for number in batch:
                    tg.start_soon(self._try_take, number, errors)
            if errors:
                raise errors[0]

    async def _try_take(self, number: int, errors: list[Exception]) -> None:
        try:
            await self._take(number)
        except Exception as exc:  # the round's first error ends it (balance_loop logs)
            errors.append(exc)

    async def _take(self, number: int) -> bool:
        name = partition_name(self.group, number)
        try:
            lease = await self._acq.acquire(name, self.ttl, None, False, None, self._tag)
        except LockHeld:
            return False
        if self._closed or number in self._owned:
            await self._acq.release(lease, quiet=True)
            return False
        partition = Partition(number, lease)
        self._owned[number] = partition
        lease.lost._on_set = lambda: self._on_lost(partition)
        self._notify()
        return True

    def _on_lost(self, partition: Partition) -> None:
        """The lease of an owned partition was lost (in ``Session.lose``, which has
        cancelled its consume's holder scope): drop it, release it once the consume has
        finished, and balance again at once (the lock may be free: take it anew).
        It may run outside any task (a driver's callback: ZooKeeper's session state), where
        nothing can be started: the balance loop starts the hand-over (it raised
        NoEventLoopError there, which stopped the driver telling the other leases lost)."""
        if self._owned.get(partition.id) is partition:
            del self._owned[partition.id]
            self._notify()
        if self._tg is not None:
            self._lost.append(partition)
        self._wake.set()

    async def _hand_over(self, partition: Partition, reason: str) -> None:
        """Give ``partition`` up: its consume cancelled and finished first, then its lock
        released, so the next owner never overlaps this one's consume."""
        if self._owned.get(partition.id) is partition:
            del self._owned[partition.id]
            self._notify()
        partition._ended._set(reason)
        with anyio.CancelScope(shield=True):
            if partition._consuming is not None:
                partition._consuming.cancel()
                await partition._done.wait()
            partition.lease.lost._on_set = None
            await self._acq.release(partition.lease, quiet=True)

    def _notify(self) -> None:
        self._version += 1
        self._changed.set()
        self._changed = anyio.Event()

    async def _consume(
        self,
        partition: Partition,
        consume: Callable[[Partition], Awaitable[Any]],
        fail: Callable[[BaseException], None],
    ) -> None:
        if self._owned.get(partition.id) is not partition:
            return  # handed over or lost before this task began
        scope = anyio.CancelScope()
        try:
            enter_body(partition, partition.lease, self._acq.current_task(), scope, LEASES.get())
        except LeaseLost:
            return
        partition._consuming = scope
        exc_info: ExcInfo = (None, None, None)
        try:
            await consume(partition)
        except BaseException as exc:
            exc_info = (type(exc), exc, exc.__traceback__)
        leave_body(partition)
        try:
            swallowed = bool(scope.__exit__(*exc_info))
        finally:
            partition._done.set()
        error = exc_info[1]
        if swallowed or error is None:
            return
        if not isinstance(error, Exception):
            raise error  # a cancellation of run() itself
        if partition.lost:
            logger.warning(
                "partitions %r: consume of partition %d raised after it was %s: %r",
                self.group,
                partition.id,
                partition.lost.reason,
                error,
            )
            return
        fail(error)


class Partitions(AsyncContextOnly):
    """``async with backend.partitions(group, count=..., ttl=...) as member:`` joins the
    group for the block and leaves it (its partitions and membership released) on exit.
    See :meth:`Backend.partitions`."""

    __slots__ = ("_acq", "_count", "_group", "_member", "_ttl")
    _usage = "backend.partitions(...)"

    def __init__(self, acq: Acquisition, group: object, count: object, ttl: object) -> None:
        self._group, self._count, self._ttl = check_partition_args(group, count, ttl)
        if self._ttl <= acq.session.min_ttl:
            raise acq.session.ttl_error(self._ttl)
        self._acq = acq
        self._member: PartitionMember | None = None

    def __repr__(self) -> str:
        return f"<Partitions {self._group!r} count={self._count} ttl={self._ttl:g}>"

    async def __aenter__(self) -> PartitionMember:
        if self._member is not None:
            raise RuntimeError("this group is already joined; make one per `async with`")
        member = PartitionMember(self._acq, self._group, self._count, self._ttl)
        await member._join()
        self._member = member
        return member

    async def __aexit__(self, *exc_info: *ExcInfo) -> None:
        member, self._member = self._member, None
        assert member is not None, "Partitions.__aexit__ without __aenter__"
        await member._leave()


class PartitionsMixin:
    """``Backend.partitions`` (a mixin of the backend: it keeps backend.py small)."""

    _acq: Acquisition

    def partitions(self, group: str, *, count: int, ttl: float) -> Partitions:
        """Join ``group``, whose keys are spread over ``count`` partitions (1 .. 10000),
        for the ``async with`` block; it yields a :class:`~asynclock.PartitionMember`.

        Each partition is owned by one live member at a time and consumed under its
        lease (``ttl``, renewed as a lock's): ``await member.run(consume)``. Members
        share the partitions evenly (⌊count/n⌋ or ⌈count/n⌉ each), a join or leave
        moves about the minimum, a dead member's partitions are free within ``ttl``.
        Needs a backend that lists names (``holders()``): NotImplementedError on entry
        otherwise. See docs/partitions.md.
        """
        return Partitions(self._acq, group, count, ttl)
