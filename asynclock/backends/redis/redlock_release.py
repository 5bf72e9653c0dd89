"""Redlock's releases: on a quorum of nodes, and those made while one is in flight sent
together, one ``REDLOCK_RELEASE_MANY`` script call per node per batch (issue 45 item 3:
2,000 blocks exiting at once on a starved machine made 6,000 replies to read, one task
each, and some read theirs past the node timeout)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..._core.exceptions import QuorumNotReached
from .._common.coalesce import Coalesced
from .fanout import Fanout, tally
from .keys import KeyCache
from .wire import pack_script

#: The most releases one REDLOCK_RELEASE_MANY call carries (a node runs 500 GET/DEL/PUBLISH
#: in about a millisecond).
RELEASE_BATCH = 500

#: A release: the lock's name, our owner id and token (None: an attempt given back).
_Release = tuple[str, str, "int | None"]


class RedlockReleases:
    """``await releases(name, owner, token)``: True if a quorum deleted our held key, False
    if a quorum answered otherwise (or an attempt's give-back), else QuorumNotReached."""

    def __init__(
        self,
        fan: Fanout,
        keys: KeyCache,
        quorum: int,
        node_timeout: float,
        display: str,
        no_quorum: Callable[[str, int, dict[str, str]], QuorumNotReached],
    ) -> None:
        self._fan, self._keys, self._quorum = fan, keys, quorum
        self._node_timeout, self._no_quorum = node_timeout, no_quorum
        self._coalesced: Coalesced[_Release, bool] = Coalesced(
            self._one, self._many, limit=RELEASE_BATCH, what=f"{display}: release"
        )

    async def __call__(self, name: str, owner: str, token: int | None) -> bool:
        return await self._coalesced(name, (name, owner, token))

    def close(self, why: str) -> None:
        self._coalesced.close(why)

    async def _one(self, release: _Release) -> bool:
        name, owner, token = release
        k = self._keys(name)
        args = (owner.encode(), b"" if token is None else b"%d" % token, k.channel)
        packed = pack_script("redlock_release", (k.lock,), args)
        # A release waiting behind this process's own calls to a node (thousands of blocks
        # exiting at once) is not timed out there: node_timeout bounds what an acquire may
        # spend of the ttl, and counts for a release from when it is sent; the core bounds
        # the whole release by its release_timeout.
        results = await self._fan.send(
            "redlock_release", packed, self._node_timeout, queue_deadline=False
        )
        answer = self._answer(release, tally(results), results)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    async def _many(self, releases: list[_Release]) -> list[bool | BaseException]:
        keys: list[bytes] = []
        args: list[bytes] = []
        for name, owner, token in releases:
            k = self._keys(name)
            keys.append(k.lock)
            args += (owner.encode(), b"" if token is None else b"%d" % token, k.channel)
        packed = pack_script("redlock_release_many", keys, args)
        results = await self._fan.send(
            "redlock_release_many", packed, self._node_timeout, queue_deadline=False
        )
        out: list[bool | BaseException] = []
        for j, release in enumerate(releases):
            # Each node's answer for this release: its j-th reply, or the node's failure.
            per_node = {
                i: r if isinstance(r, BaseException) else int(r[j]) for i, r in results.items()
            }
            out.append(self._answer(release, tally(per_node), results))
        return out

    def _answer(
        self, release: _Release, counts: tuple[int, int], results: dict[int, Any]
    ) -> bool | QuorumNotReached:
        """A release's answer from how many nodes answered and how many removed our key."""
        name, _, token = release
        answered, removed = counts
        if removed >= self._quorum:
            return True
        if answered >= self._quorum or token is None:
            return False
        return self._no_quorum(f"release of {name!r}", answered, self._fan.failures(results))
