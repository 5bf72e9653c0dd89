"""Read-write locks of ``memory://`` (:mod:`.memory`): each lock's state in the driver's
``rwlocks`` dict; every step runs without an await, so each is atomic."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .._core.driver import ExtendResult, LeaseRef, Refused
from .._core.holder import Holder
from .._core.rw_store import (
    READ,
    READERS_HOLD,
    WRITER_HOLDS,
    WRITER_WAITS,
    Held,
    RWAnswer,
    RWStore,
    rw_holders,
)

if TYPE_CHECKING:
    from .memory import MemoryDriver


@dataclass(slots=True)
class RWState:
    #: The last write hold's token (kept for ever: G2 for the name's writers).
    epoch: int = 0
    #: owner -> expiry of each reader (every live one holds the current epoch).
    readers: dict[str, float] = field(default_factory=dict)
    #: (owner, expiry) of the writer (it holds the current epoch), if any.
    writer: tuple[str, float] | None = None
    #: owner -> expiry of each waiting writer's intent.
    intents: dict[str, float] = field(default_factory=dict)


class MemoryRW(RWStore):
    """A read-write lock in the driver's dicts (see the module)."""

    renew_chunk = None
    display = "memory://"

    def __init__(self, driver: MemoryDriver, name: str) -> None:
        super().__init__(name)
        self.driver = driver

    def _live(self) -> tuple[RWState, float]:
        """The name's state with everything expired dropped, and now."""
        now = self.driver.clock.now()
        state: RWState = self.driver.rwlocks.setdefault(self.name, RWState())
        for table in (state.readers, state.intents):
            for owner in [o for o, t in table.items() if t <= now]:
                del table[owner]
        if state.writer is not None and state.writer[1] <= now:
            state.writer = None
        return state, now

    async def grant(self, mode: str, owner: str, ttl: float, *, intend: bool) -> RWAnswer:
        state, now = self._live()
        if state.writer is not None:
            if intend:
                state.intents[owner] = now + ttl
            return Held(WRITER_HOLDS, state.writer[1] - now)
        if mode == READ:
            if state.intents:
                return Held(WRITER_WAITS)
            state.readers[owner] = now + ttl
            return state.epoch
        if state.readers:
            if intend:
                state.intents[owner] = now + ttl
            return Held(READERS_HOLD, min(state.readers.values()) - now)
        state.intents.pop(owner, None)
        state.epoch += 1
        state.writer = (owner, now + ttl)
        return state.epoch

    def _holds(self, state: RWState, mode: str, owner: str, token: int | None) -> bool:
        if token is not None and token != state.epoch:
            return False
        if mode == READ:
            return owner in state.readers
        return state.writer is not None and state.writer[0] == owner

    async def extend(self, mode: str, leases: Sequence[LeaseRef]) -> Sequence[ExtendResult]:
        state, now = self._live()
        results: list[ExtendResult] = []
        for ref in leases:
            if not self._holds(state, mode, ref.owner, ref.token):
                results.append(Refused("the hold is gone (expired or released)"))
            elif mode == READ:
                state.readers[ref.owner] = now + ref.ttl
                results.append(True)
            else:
                state.writer = (ref.owner, now + ref.ttl)
                results.append(True)
        return results

    async def release_hold(self, mode: str, owner: str, token: int | None) -> bool:
        state, _ = self._live()
        if not self._holds(state, mode, owner, token):
            return False
        if mode == READ:
            del state.readers[owner]
        else:
            state.writer = None
        return True

    async def withdraw(self, owner: str) -> None:
        state, _ = self._live()
        state.intents.pop(owner, None)

    async def holders(self) -> list[Holder]:
        state, now = self._live()
        w = state.writer
        return rw_holders(
            self.name,
            state.epoch,
            None if w is None else (w[0], w[1] - now),
            [(o, t - now) for o, t in state.readers.items()],
            [(o, t - now) for o, t in state.intents.items()],
        )
