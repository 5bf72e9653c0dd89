"""kazoo behind a thread bridge: the one module that touches kazoo (untyped, threads).

Why kazoo: it is ZooKeeper's standard Python client, maintained, and complete (sessions,
reconnects across an ensemble, chroot, digest auth, TLS, create2 with the new node's stat).
It runs its own I/O thread; every call here is kazoo's ``*_async`` form, whose completion
callback (on kazoo's callback thread) settles an asyncio future with
``call_soon_threadsafe``: no worker thread per call, and requests are pipelined on the one
connection in the order they are made (ZooKeeper answers a session's requests in order).
The create of an acquire and the listing of its siblings go out together and come back
in one hand-over to the loop. Measured (benchmarks/bench_zookeeper.py, one run on a loaded
2-core machine): asynclock acquire+release 1.47 ms, this bridge's create+delete 1.22 ms
(0.83x), kazoo's blocking create+delete 0.94 ms, kazoo's ``Lock`` 1.76 ms.

kazoo does not expose the session timeout the server negotiated, which the driver's G3
deadline needs; it logs it once per session ("Session created, ... negotiated session
timeout: %s"), so ``_connecting.Capture`` reads it from that record.
tests/backends/test_zookeeper.py::test_negotiated_timeout_is_read pins this.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from kazoo.client import KazooClient
from kazoo.exceptions import (
    AuthFailedError,
    BadVersionError,
    NoAuthError,
    NodeExistsError,
    NoNodeError,
    NotEmptyError,
    SessionExpiredError,
)
from kazoo.protocol.states import Callback, KazooState

from ._connecting import Capture, handshake_bound, reconnect_policy

__all__ = (
    "AuthFailedError",
    "BadVersionError",
    "Multi",
    "NoAuthError",
    "NoNodeError",
    "NodeExistsError",
    "NotEmptyError",
    "Op",
    "Request",
    "SessionExpiredError",
    "Stat",
    "Zk",
)


@dataclass(frozen=True, slots=True)
class Stat:
    """The parts of a znode's stat the driver reads."""

    czxid: int
    mtime: int  # ms since the epoch, the server's clock at the last write
    version: int
    ephemeral: bool = True  # False: a persistent node (no lock protocol makes one)
    mzxid: int = 0  # the transaction id of the last write
    ctime: int = 0  # ms since the epoch, the server's clock at the node's creation
    children: int = 0  # how many children the node has


def _stat(raw: Any) -> Stat:
    return Stat(
        int(raw.czxid),
        int(raw.mtime),
        int(raw.version),
        bool(raw.ephemeralOwner),
        int(raw.mzxid),
        int(raw.ctime),
        int(raw.numChildren),
    )


class Op(NamedTuple):
    """One operation of a :meth:`Zk.multi` transaction: ``create`` (``data``,
    ``ephemeral``, ``sequence``: the path's end is a sequence number the server appends),
    ``delete`` and ``set`` (``data``) if the node's data version is ``version`` (-1: any),
    ``check`` that it is."""

    kind: str
    path: str
    data: bytes = b""
    version: int = -1
    ephemeral: bool = False
    sequence: bool = False


#: One request of :meth:`Zk.pipeline`: ``("get", path)``, ``("children", path)``,
#: ``("exists", path)``, ``("set", path, data, version)``, ``("delete", path, version)`` or
#: ``("multi", ops)``.
Request = tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class Multi:
    """A transaction's answer: applied (``results``, one per op: the created path, True,
    or a set's :class:`Stat`), or not (``failed_at``: the op that failed, with ``error``);
    ``read``: the stat of the node read behind it (None: absent or not asked)."""

    results: list[Any]
    failed_at: int | None
    error: BaseException | None
    read: Stat | None


class Zk:
    """One kazoo client (one ZooKeeper session at a time), awaited from asyncio."""

    def __init__(
        self,
        hosts: str,
        *,
        session_timeout: float,
        auth: tuple[str, str] | None,
        on_state: Callable[[str], None],
    ) -> None:
        self.requested_ms = int(session_timeout * 1000)
        #: The session timeout the server granted, ms (None until a session exists).
        self.negotiated_ms: int | None = None
        self._on_state = on_state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._hosts = max(1, len(hosts.partition("/")[0].split(",")))
        self._refusals = 0
        auth_data = [("digest", f"{auth[0]}:{auth[1]}")] if auth is not None else None
        self.client = KazooClient(
            hosts=hosts,
            timeout=session_timeout,
            auth_data=auth_data,
            logger=Capture(
                self._negotiated,
                self._refused,
                self._cut_handshake,
                handshake_bound(session_timeout, self._hosts),
            ),
            randomize_hosts=True,
            connection_retry=reconnect_policy(session_timeout),
        )
        self.client.add_listener(self._listener)

    def _cut_handshake(self) -> None:
        """(A timer thread.) kazoo's connection thread waits for the answer to a session
        request the server took and does not answer: shut the socket down; kazoo reads its
        end as a dropped connection and tries again, with the same session."""
        connection = getattr(self.client, "_connection", None)  # kazoo's ConnectionHandler
        sock = getattr(connection, "_socket", None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _negotiated(self, ms: int) -> None:
        self._refusals = 0
        self.negotiated_ms = ms

    def _refused(self) -> None:
        """kazoo's connection thread: a server closed our session request. A server that
        has not seen the last transaction this client saw refuses it ("Refusing session
        request ... as it has seen zxid"): a lagging member (kazoo tries the next), or an
        ensemble that lost its data (a wiped or restored data directory), where every
        member refuses for ever and kazoo would retry for ever. Once each member refused
        in a row, ask again as a client that saw nothing: the server then answers that the
        session expired (it does not know it) and kazoo opens a new one (issue 39)."""
        self._refusals += 1
        if self._refusals < max(2, self._hosts):
            return
        self._refusals = 0
        if self.client.last_zxid:
            self.client.last_zxid = 0  # read by this same thread's next attempt
            self._hand_over("refused")

    def _listener(self, state: Any) -> bool:
        # On kazoo's thread: hand the state to the loop. Never blocks.
        name = {
            KazooState.LOST: "lost",
            KazooState.SUSPENDED: "suspended",
            KazooState.CONNECTED: "connected",
        }.get(state, str(state))
        self._hand_over(name)
        return False  # stay registered

    def _hand_over(self, state: str) -> None:
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed
                loop.call_soon_threadsafe(self._on_state, state)

    @property
    def session_id(self) -> int | None:
        cid = self.client.client_id
        return None if cid is None else int(cid[0])

    def start(self, timeout: float) -> None:
        """Blocking: connect (run it in a worker thread)."""
        self.client.start(timeout=timeout)

    def stop(self) -> None:
        """Blocking: close the session (its ephemeral nodes go at once) and the threads."""
        try:
            self.client.stop()
        finally:
            self.client.close()

    def bind_loop(self) -> None:
        self._loop = asyncio.get_running_loop()

    async def _wait(self, result: Any, settled_too: Any = None) -> Any:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()

        def settle(done: Any) -> None:
            if future.done():
                return
            if done.successful():
                future.set_result(done.value)
            else:
                future.set_exception(done.exception)

        def callback(done: Any) -> None:  # kazoo's callback thread
            if settled_too is not None:
                settled_too.wait()  # answered before ``done``: returns at once
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(settle, done)

        result.rawlink(callback)
        return await future

    # -- the operations the driver needs ----------------------------------------------------

    def create_ephemeral_sequential(self, path: str, data: bytes) -> Any:
        """Send now; await the returned handle with :meth:`created`."""
        return self.client.create_async(
            path, data, ephemeral=True, sequence=True, include_data=True
        )

    async def created(self, pending: Any) -> tuple[str, Stat]:
        path, stat = await self._wait(pending)
        return str(path), _stat(stat)

    async def create_and_list(
        self, path: str, data: bytes, parent: str
    ) -> tuple[tuple[str, Stat] | BaseException, list[str] | BaseException]:
        """Create an ephemeral sequential node and list ``parent``'s children, pipelined:
        one round trip, and one hand-over to the loop (ZooKeeper answers a session's
        requests in order, so the listing's answer comes after the create's and sees it).
        Each result is the value or the exception it raised."""
        created = self.create_ephemeral_sequential(path, data)
        listed = self.client.get_children_async(parent)
        with contextlib.suppress(Exception):  # read from the two results below
            await self._wait(listed, settled_too=created)
        first: tuple[str, Stat] | BaseException
        if created.successful():
            new_path, stat = created.value
            first = (str(new_path), _stat(stat))
        else:
            first = created.exception
        second = [str(c) for c in listed.value] if listed.successful() else listed.exception
        return first, second

    def children_request(self, path: str) -> Any:
        return self.client.get_children_async(path)

    async def children_of(self, pending: Any) -> list[str]:
        return [str(c) for c in await self._wait(pending)]

    async def children(self, path: str) -> list[str]:
        return await self.children_of(self.children_request(path))

    async def ensure_path(self, path: str) -> None:
        await self._wait(self.client.ensure_path_async(path))

    async def exists(self, path: str, watch: Callable[[Any], None] | None = None) -> Stat | None:
        raw = await self._wait(self.client.exists_async(path, watch=watch))
        return None if raw is None else _stat(raw)

    async def get(self, path: str) -> tuple[bytes, Stat]:
        data, raw = await self._wait(self.client.get_async(path))
        return bytes(data), _stat(raw)

    async def exists_watched(self, path: str, watch: Callable[[Any], None]) -> bool:
        """Set a one-shot data watch on ``path`` (``watch(event)`` runs on kazoo's thread
        when the node changes or goes); False, and no watch left behind, if it is gone
        already (a read, not ``exists``: that would watch for the node's creation)."""
        try:
            await self._wait(self.client.get_async(path, watch=watch))
        except NoNodeError:
            return False
        return True

    def watch_node(self, path: str, on_event: Callable[[str], None]) -> None:
        """Watch ``path`` (a node of ours) without waiting: ``on_event(kind)`` runs on the
        loop once, with the watch event's type (``DELETED``, ``CHANGED``; ``NONE``: the
        session ended), ``MISSING`` if the node was already gone, or ``FAILED`` if the
        watch could not be set (the connection is down)."""
        loop = self._loop
        if loop is None:  # pragma: no cover - bound at open
            return

        def hand_over(kind: str) -> None:  # kazoo's threads
            with contextlib.suppress(RuntimeError):  # the loop is closed
                loop.call_soon_threadsafe(on_event, kind)

        def answered(done: Any) -> None:
            if done.successful():
                return
            hand_over("MISSING" if isinstance(done.exception, NoNodeError) else "FAILED")

        pending = self.client.get_async(path, watch=lambda event: hand_over(str(event.type)))
        pending.rawlink(answered)

    async def sync(self) -> None:
        """One round trip through the leader (``sync``): the session is alive, this
        server has caught up with every write committed before it, and every watch event
        those writes fired has been handed to the loop before this returns."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        dispatch = self.client.handler.dispatch_callback

        def settle(done: Any) -> None:
            if future.done():
                return
            if done.successful():
                future.set_result(None)
            else:
                future.set_exception(done.exception)

        def behind_the_watches(done: Any) -> None:
            # kazoo hands watch events to its callback thread and answers to its
            # completion thread: queue the answer behind the events read before it.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(settle, done)

        def answered(done: Any) -> None:  # kazoo's completion thread
            dispatch(Callback("watch", behind_the_watches, (done,)))

        self.client.sync_async("/").rawlink(answered)
        await future

    async def set_data(self, path: str, data: bytes, version: int = -1) -> Stat:
        return _stat(await self._wait(self.client.set_async(path, data, version)))

    async def create(self, path: str, data: bytes) -> Stat:
        """Create a persistent node; its stat (its creation's zxid and time)."""
        pending = self.client.create_async(path, data, include_data=True)
        _, stat = await self._wait(pending)
        return _stat(stat)

    async def delete(self, path: str, version: int = -1) -> None:
        await self._wait(self.client.delete_async(path, version))

    def _commit(self, ops: Sequence[Op]) -> Any:
        tx = self.client.transaction()
        for op in ops:
            if op.kind == "create":
                tx.create(op.path, op.data, ephemeral=op.ephemeral, sequence=op.sequence)
            elif op.kind == "delete":
                tx.delete(op.path, op.version)
            elif op.kind == "set":
                tx.set_data(op.path, op.data, op.version)
            else:
                tx.check(op.path, op.version)
        return tx.commit_async()

    @staticmethod
    def _answer(values: list[Any], stat: Stat | None = None) -> Multi:
        results = [_stat(r) if hasattr(r, "czxid") else r for r in values]
        for at, result in enumerate(results):
            # The failed op's own error; RolledBack before it, RuntimeInconsistency after.
            if isinstance(result, (NodeExistsError, NoNodeError, NotEmptyError, BadVersionError)):
                return Multi(results, at, result, stat)
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            return Multi(results, len(results) - 1, failed, stat)
        return Multi(results, None, None, stat)

    async def multi(self, ops: Sequence[Op], read: str | None = None) -> Multi:
        """One ZooKeeper ``multi``: every op applied in one transaction (one zxid) or none.
        ``read``: ``exists`` of that path pipelined behind it (answered after it, so it
        sees its writes): one round trip."""
        committed = self._commit(ops)
        looked = None if read is None else self.client.exists_async(read)
        with contextlib.suppress(Exception):  # read from the results below
            if looked is None:
                await self._wait(committed)
            else:
                await self._wait(looked, settled_too=committed)
        if not committed.successful():
            raise committed.exception
        stat = None
        if looked is not None:
            if not looked.successful():
                raise looked.exception
            stat = None if looked.value is None else _stat(looked.value)
        return self._answer(committed.value, stat)

    async def pipeline(self, requests: Sequence[Request]) -> list[Any]:
        """Every request sent at once, in order (one round trip; ZooKeeper answers a
        session's requests in order, so each sees the writes before it): one answer per
        request, the value or the exception it raised. ``get``: (data, :class:`Stat`);
        ``children``: the names; ``exists``: a :class:`Stat` or None; ``set``: the
        :class:`Stat`; ``delete``: True; ``multi``: a :class:`Multi`."""
        client = self.client
        start = {
            "get": client.get_async,
            "children": client.get_children_async,
            "exists": client.exists_async,
            "set": client.set_async,
            "delete": client.delete_async,
            "multi": self._commit,
        }
        pending = [start[kind](*args) for kind, *args in requests]
        for one in pending:
            with contextlib.suppress(Exception):  # read from the results below
                await self._wait(one)
        answers: list[Any] = []
        for (kind, *_), one in zip(requests, pending, strict=True):
            if not one.successful():
                answers.append(one.exception)
            elif kind == "get":
                answers.append((bytes(one.value[0]), _stat(one.value[1])))
            elif kind == "children":
                answers.append([str(c) for c in one.value])
            elif kind in ("exists", "set"):
                answers.append(None if one.value is None else _stat(one.value))
            elif kind == "multi":
                answers.append(self._answer(one.value))
            else:
                answers.append(one.value)
        return answers

    async def get_and_children(
        self, path: str, parent: str
    ) -> tuple[tuple[bytes, Stat] | BaseException, list[str] | BaseException]:
        """``get`` of ``path`` and the children of ``parent``, pipelined (one round trip);
        each the value or the exception it raised."""
        got, listed = await self.pipeline([("get", path), ("children", parent)])
        return got, listed

    async def read_many(
        self, paths: Sequence[str], parents: Sequence[str] = ()
    ) -> tuple[list[tuple[bytes, Stat] | BaseException], list[list[str] | BaseException]]:
        """``get`` of every path and the children of every parent, pipelined (one round
        trip): each the value or the exception it raised, in the order asked."""
        gets = [self.client.get_async(p) for p in paths]
        lists = [self.client.get_children_async(p) for p in parents]
        for pending in (*gets, *lists):
            with contextlib.suppress(Exception):  # read from the results below
                await self._wait(pending)
        got: list[tuple[bytes, Stat] | BaseException] = [
            (bytes(g.value[0]), _stat(g.value[1])) if g.successful() else g.exception for g in gets
        ]
        listed: list[list[str] | BaseException] = [
            [str(c) for c in x.value] if x.successful() else x.exception for x in lists
        ]
        return got, listed
