"""Wake-ups of the SQLite backend's queued waiters, one waiter at a time (no herd).

On Linux each backend listens on an abstract Unix datagram socket named in its queue rows
(``asynclock_waiter.wake``). A release (or a waiter leaving the head of the queue) sends one
datagram to the head waiter's backend naming the name *and the waiter*, and that backend
wakes that one task; a head in this very backend is woken without a datagram. Only the
head asks the database while it waits: the waiters behind it sleep until they are woken.

Their places are kept by one statement per backend: every ``WAITER_TTL / 3`` it refreshes
the expiry of all this backend's queue rows (instead of each waiter rewriting its own row
a few times a second), and it wakes a local waiter that has become the head without a
release (the one before it left, or its place ran out). So the work while W tasks wait is
one statement per interval, and a hand-off is one datagram, whatever W is.

A datagram is ``b"\\xff" + b"<length of owner>:" + owner + name`` (UTF-8; 0xFF never
starts UTF-8 text, so a datagram from an older asynclock, the bare name, still reads: it
wakes every waiter of the name here).
"""

from __future__ import annotations

import socket
import sqlite3
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import anyio

from ..._core.driver import Driver
from ..._core.turns import Turns
from .sql import SQL_FORGET_DEAD, SQL_FORGET_WAITER, SQL_HEAD, SQL_KEEP_PLACES, SQL_QUEUE
from .waiting import WAITER_TTL, _Waiting

T = TypeVar("T")

_MARK = b"\xff"


def encode(name: str, owner: str) -> bytes:
    """The datagram that wakes the waiter ``owner`` of ``name``."""
    who = owner.encode("utf-8", "surrogatepass")
    return _MARK + b"%d:" % len(who) + who + name.encode("utf-8", "surrogatepass")


def decode(data: bytes) -> tuple[str, str | None]:
    """(name, owner) of a datagram; owner None: every waiter of the name (old format)."""
    if data[:1] != _MARK:
        return data.decode("utf-8", "replace"), None
    length, _, rest = data[1:].partition(b":")
    n = int(length)
    return rest[n:].decode("utf-8", "surrogatepass"), rest[:n].decode("utf-8", "surrogatepass")


class Waking(Driver):
    """The wake-up half of :class:`~asynclock.backends.sqlite.SQLiteDriver`."""

    boot: str
    _sock: socket.socket | None
    _address: str | None
    _queued: set[tuple[str, str]]
    _seen: dict[tuple[str, str], _Waiting]
    _turns: Turns
    _arrived: dict[tuple[str, str], float]

    if TYPE_CHECKING:

        @property
        def db(self) -> sqlite3.Connection: ...

        async def _write(self, fn: Callable[[sqlite3.Connection], T]) -> T: ...

        def _try_statement(self, sql: str, args: tuple[Any, ...]) -> sqlite3.Cursor | None: ...

    def _init_waking(self) -> None:
        #: The local head last woken per name by :meth:`_keep_places` (woken once).
        self._heads: dict[str, str] = {}
        #: Rows of waiters gone whose delete failed (busy): deleted by the place keeper,
        #: which would otherwise keep their places for ever.
        self._gone: set[tuple[str, str]] = set()
        self._waiting_now = anyio.Event()  # set when a waiter queues (the keeper starts)

    async def background(self) -> None:
        """Receive wake-ups from other processes and keep this backend's places."""
        sock = self._sock
        if sock is None:
            return
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._keep_places)
            while True:
                await anyio.wait_readable(sock)
                while True:
                    try:
                        data = sock.recv(4096)
                    except (BlockingIOError, InterruptedError):
                        break
                    except OSError:
                        tg.cancel_scope.cancel()
                        return
                    name, owner = decode(data)
                    self._wake_waiter(name, owner)

    def _queued_one(self) -> None:
        """A waiter of this backend queued: the place keeper runs while any does."""
        self._waiting_now.set()

    async def _keep_places(self) -> None:
        """Every WAITER_TTL / 3 while tasks here wait: refresh all their queue rows in one
        statement, and wake a local waiter that became the head of its queue."""
        while True:
            if not self._queued:
                self._heads.clear()
                self._waiting_now = anyio.Event()
                await self._waiting_now.wait()
            await anyio.sleep(WAITER_TTL / 3)
            if not self._queued:
                continue
            names = {name for name, _ in self._queued}
            gone = list(self._gone)
            try:
                heads = await self._write(partial(self._keep, names=names, gone=gone))
            except Exception:  # tried again next time (a place lasts WAITER_TTL)
                continue
            self._gone.difference_update(gone)
            for name, owner in heads:
                if self._heads.get(name) != owner and (name, owner) in self._queued:
                    self._heads[name] = owner
                    self._wake_waiter(name, owner)

    def _keep(
        self, db: sqlite3.Connection, *, names: set[str], gone: list[tuple[str, str]]
    ) -> list[tuple[str, str]]:
        """In one transaction: delete the rows of ``gone``, refresh every place of this
        backend, and find the names whose head waiter is one of ours: (name, owner)."""
        now, boot, address = time.monotonic(), self.boot, self._address
        db.executemany(SQL_FORGET_WAITER, gone)
        db.execute(SQL_KEEP_PLACES, (now + WAITER_TTL, address, boot))
        heads = []
        for name in names:
            head = db.execute(SQL_HEAD, (name, boot, now)).fetchone()
            if head is not None and head[1] == address:
                heads.append((name, str(head[0])))
        return heads

    # -- the backend's own line of waiters per name (see the driver's acquire) ------------

    def _next_turn(self, name: str, after: str | None) -> None:
        """The first of this backend's line for ``name`` left it: wake ``after``, the next,
        unless the leaving transaction queued it in the file (``_queue_next``) and a
        release's datagram will wake it when its turn comes there. Without datagrams
        (not Linux) it is woken to poll."""
        if after is not None and ((name, after) not in self._queued or self._address is None):
            self._wake(name, after)

    def _queue_next(self, db: sqlite3.Connection, name: str, now: float) -> tuple[str, str] | None:
        """In the transaction where the first of this backend's line for ``name`` leaves the
        file's queue (granted or gone): queue the next of the line in its place, its
        arrival time, so no waiter of another backend that came later slips in between.
        Returns its key for :meth:`_handed`, once the transaction has committed."""
        after = self._turns.second(name)
        if after is None:
            return None
        key = (name, after)
        place = self._arrived.get(key, now)
        db.execute(SQL_QUEUE, (name, after, now + WAITER_TTL, self.boot, self._address, place))
        return key

    def _handed(self, handed: list[tuple[str, str] | None]) -> None:
        """After the commit: the waiters :meth:`_queue_next` queued have rows in the file
        (the place keeper keeps them; a release's datagram wakes them)."""
        for key in handed:
            if key is not None:
                self._queued.add(key)
                self._queued_one()

    def _wake_waiter(self, name: str, owner: str | None) -> None:
        """Wake the local waiter ``owner`` of ``name`` (None: every local waiter of it)."""
        if owner is None:
            for (seen_name, _), seen in self._seen.items():
                if seen_name == name:
                    seen.woken = True
        else:
            one = self._seen.get((name, owner))
            if one is not None:
                one.woken = True
        self._wake(name, owner)

    def _notify_next(self, name: str) -> None:
        """After a release: tell the first live waiter (any process) to try now."""
        head = self.db.execute(SQL_HEAD, (name, self.boot, time.monotonic())).fetchone()
        if head is not None and head[1]:
            self._wake_head(name, head[1], head[0])

    def _wake_head(self, name: str, address: str | None, owner: str | None) -> None:
        """Wake the head waiter ``owner`` at ``address``. One whose process is gone (nobody
        listens there) loses its place at once and the next is woken, so a dead waiter
        does not hold up the live ones behind it for its ``WAITER_TTL``."""
        if not address:  # its backend has no socket (not Linux): it polls, unless ours
            self._wake_waiter(name, owner)
            return
        for _ in range(8):
            if self._send_wake(name, address, owner):
                return
            if self._try_statement(SQL_FORGET_DEAD, (name, address)) is None:
                return  # busy: its place runs out within WAITER_TTL instead
            head = self.db.execute(SQL_HEAD, (name, self.boot, time.monotonic())).fetchone()
            if head is None or not head[1]:
                return
            owner, address = head

    def _send_wake(self, name: str, address: str, owner: str | None) -> bool:
        """Send the wake-up; False if nobody listens on ``address`` (its process is gone)."""
        if self._sock is None or address == self._address:
            self._wake_waiter(name, owner)  # ours: no datagram
            return True
        try:
            data = encode(name, owner) if owner is not None else name.encode()
            self._sock.sendto(data, "\0" + address)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:
            pass  # e.g. its buffer is full: that waiter polls as a fallback
        return True
