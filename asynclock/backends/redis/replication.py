"""``wait_replicas``: a grant, renewal or idempotency record counts only once ``N`` replicas
have it (``WAIT N timeout``), so a failover that promotes one of them keeps it.

Since Redis 7.0 ``WAIT`` inside a script does not block, so it is its own command, sent
right after the script on the *same connection*: ``WAIT`` counts the replicas that have
that connection's writes (:meth:`Node.call_then`). A grant the replicas did not confirm is
given back and the acquire fails with :class:`NotReplicated`, whose message says what to
change; a renewal they did not confirm is not a refusal: the core retries it and, meanwhile,
does not move the lease's local deadline (G3 holds on the replicas too).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import redis.exceptions

from ..._core.exceptions import BackendUnavailable
from ..._core.validation import check_seconds
from .scripts import SCRIPTS
from .wire import Node, Wire, drop_connection, pack, pack_script, parse_run_id


class NotReplicated(BackendUnavailable):
    """Fewer replicas than ``wait_replicas`` confirmed a write within ``wait_timeout``."""


class Restarted(BackendUnavailable):
    """Another server answers at a primary's address (a new ``run_id``): what the old one
    granted is lost, and the call is asked again once the driver has caught up."""


@dataclass(frozen=True, slots=True)
class Wait:
    """``WAIT replicas timeout``: how many replicas must confirm, and for how long to wait."""

    replicas: int
    timeout: float

    @classmethod
    def of(cls, replicas: object, timeout: object) -> Wait | None:
        """The checked options (None: ``wait_replicas=0``, WAIT off)."""
        if isinstance(replicas, str) and replicas.strip().isdigit():
            replicas = int(replicas)
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise ValueError(
                f"wait_replicas must be an int >= 0 (the replicas that must confirm each "
                f"grant and renewal; 0 turns WAIT off), got {replicas!r}"
            )
        seconds = check_seconds(timeout, "wait_timeout", text=True)
        return cls(replicas, seconds) if replicas else None

    @property
    def command(self) -> bytes:
        return pack(b"WAIT", b"%d" % self.replicas, b"%d" % max(1, math.ceil(self.timeout * 1000)))

    def failure(self, display: str, what: str, acked: int) -> NotReplicated:
        """What to say when only ``acked`` replicas confirmed ``what``."""
        return NotReplicated(
            f"{display}: {what} reached {acked} of the {self.replicas} replica(s) "
            f"wait_replicas={self.replicas} asks for within wait_timeout={self.timeout:g}s "
            f"(WAIT {self.replicas} {max(1, math.ceil(self.timeout * 1000))}), so it does not "
            "count: a failover could promote a replica without it. The primary has fewer "
            "replicas in sync than that (INFO replication: connected_slaves), or they lag "
            "more than wait_timeout: set wait_replicas to the replicas you run (at most), "
            "raise wait_timeout, or mend replication; wait_replicas=0 turns WAIT off (a "
            "failover may then lose the last grants; the restart grace and the fence still "
            "hold)"
        )


def _granted(reply: Any) -> bool:
    return isinstance(reply, list) and bool(reply) and bool(reply[0])


def _always(reply: Any) -> bool:
    return True


#: Scripts whose success must reach the replicas: when it succeeded, and what it made.
_CONFIRMED = {
    "acquire": (_granted, "the grant"),
    "record_put": (lambda r: r == 1, "the record"),
    "extend": (_always, "the renewal"),
    "cluster_extend": (_always, "the renewal"),
    # Semaphores and read-write locks (:mod:`.routed_holds`): an unconfirmed grant or
    # renewal fails with NotReplicated (the core gives a grant back, retries a renewal).
    "sem_grant": (lambda r: int(r[0]) >= 0, "the permit's grant"),
    "sem_extend": (_always, "the permits' renewal"),
    "rw_grant": (lambda r: int(r[0]) == 1, "the read-write hold's grant"),
    "rw_extend": (_always, "the read-write holds' renewal"),
}

#: Scripts that fail (NotReplicated) when the replicas do not confirm them in ``run``
#: (the lock renewals read the count themselves: :meth:`~.routed.Routed.confirmed`).
_STRICT = frozenset(_CONFIRMED) - {"extend", "cluster_extend"}

#: Set (in the calling task's context) to send ``ASKING`` before the next command: Redis
#: Cluster's answer to ``ASK`` (a slot half migrated to this node).
ASKING: ContextVar[bool] = ContextVar("asynclock_redis_asking", default=False)
_ASKING = pack(b"ASKING")


_INFO_SERVER = pack(b"INFO", b"server")


class ReplicatedNode(Node):
    """A primary: :class:`Node`, with ``WAIT`` after the scripts that grant (see module),
    ``ASKING`` first where :data:`ASKING` says so, and a restart noticed on every new
    command connection (:meth:`_connect`)."""

    wait: Wait | None = None
    #: Told the new ``run_id`` when a new connection finds one (None: not checked).
    on_restart: Callable[[str], None] | None = None

    async def _connect(self) -> Wire:
        """A new command connection, refused (:class:`Restarted`) when it reaches another
        server than the one last seen: a call on it could grant before the driver has
        lost the old server's leases and adopted the new one (ADOPT: its grace and
        token floor). One ``INFO server`` per new connection; none when INFO is denied."""
        wire = await super()._connect()
        known, told = self.run_id, self.on_restart
        if known is None or told is None:
            return wire
        try:
            await wire.conn.send_packed_command(_INFO_SERVER, check_health=False)
            run_id = parse_run_id(await wire.read())
        except redis.exceptions.ResponseError:
            return wire  # INFO denied: the pub/sub reconnect tells
        except BaseException:
            await drop_connection(wire.conn)
            raise
        if run_id is None or run_id == known:
            return wire
        told(run_id)
        await self._keep(wire)
        raise Restarted(
            f"{self.display}: the server restarted (run_id {known} is now {run_id}); "
            "the leases it granted are lost"
        )

    async def run(
        self,
        script: str,
        keys: Sequence[bytes],
        args: Sequence[bytes],
        timeout: float | None = None,
    ) -> Any:
        confirm = _CONFIRMED.get(script) if self.wait is not None else None
        if confirm is None and not ASKING.get():
            return await super().run(script, keys, args, timeout)
        reply, acked = await self.run_waited(script, keys, args, timeout)
        wait = self.wait
        if (
            wait is not None
            and confirm is not None
            and script in _STRICT
            and acked is not None
            and acked < wait.replicas
        ):
            raise wait.failure(self.display, confirm[1], acked)
        return reply

    async def run_waited(
        self,
        script: str,
        keys: Sequence[bytes],
        args: Sequence[bytes],
        timeout: float | None = None,
    ) -> tuple[Any, int | None]:
        """EVALSHA ``script`` (after ``ASKING`` if asked), then ``WAIT`` on the same
        connection if it succeeded and ``wait_replicas`` is set: (reply, replicas that
        confirmed, or None if none were asked)."""
        wait = self.wait
        confirm = _CONFIRMED.get(script) if wait is not None else None
        extra = wait.timeout if wait is not None and confirm is not None else 0.0
        deadline = self.deadline((self.socket_timeout if timeout is None else timeout) + extra)
        packed = pack_script(script, keys, args)
        asking = ASKING.get()
        first = _ASKING if asking else packed

        def then(reply: Any) -> bytes | None:
            nonlocal first
            if first is _ASKING:
                first = packed
                return packed
            if wait is not None and confirm is not None and first is packed and confirm[0](reply):
                first = b""
                return wait.command
            return None

        try:
            try:
                replies = await self.call_chain(first, deadline, then)
            except redis.exceptions.NoScriptError:
                await self.call(pack(b"SCRIPT", b"LOAD", SCRIPTS[script].encode()), deadline)
                first = _ASKING if asking else packed
                replies = await self.call_chain(first, deadline, then)
        except Exception as exc:
            raise self.error(script, exc) from exc
        if asking:
            replies = replies[1:]
        return replies[0], (int(replies[1]) if len(replies) > 1 else None)

    async def get(self, key: bytes) -> bytes | None:
        if not ASKING.get():
            return await super().get(key)
        follow: list[bytes] = [pack(b"GET", key)]
        try:
            replies = await self.call_chain(
                _ASKING, self.deadline(), lambda _: follow.pop() if follow else None
            )
        except Exception as exc:
            raise self.error("get", exc) from exc
        value = replies[-1]
        return value if isinstance(value, bytes) or value is None else str(value).encode()
