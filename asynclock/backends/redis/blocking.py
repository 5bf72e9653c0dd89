"""Blocking acquire and release on one Redis server, for threads other than the loop's.

A Celery worker runs its task bodies on its own thread while the backend lives on an
event-loop thread. Asking the loop for every acquire and release costs two thread
hand-overs and the asyncio machinery per call; these calls make the same script round
trip on the calling thread instead, with a plain redis-py connection (a small pool shared
by the threads of a process; redis-py's pool makes a fresh one after a fork). The scripts,
keys and arguments are the driver's own (:mod:`.single`), so tokens, the fair queue and
the restart grace behave exactly as for the loop's calls: an acquire here respects the
wait queue but never joins it, and a busy answer (or a restart grace) sends the caller
to the loop's full acquire, which waits, queues and explains.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any

import redis
import redis.exceptions

from .replies import grace_ms
from .scripts import NO_QUEUE, RESPECT_QUEUE, SCRIPTS
from .wire import _NO_CLIENT_INFO, _resp2, ms, pack, pack_script

if TYPE_CHECKING:
    from .single import RedisDriver


class BlockingCalls:
    """:class:`asynclock._core.driver.ThreadCalls` for :class:`~.single.RedisDriver`.

    One connection per thread, kept for the thread's life (redis-py's pool costs as much
    CPU per call as the call's own parsing: events, metrics, a lock); made by redis-py from
    the driver's URL and options, so AUTH/ACL, TLS, ``SELECT`` and unix sockets are the
    driver's. A connection made before a fork is never used in the child.
    """

    def __init__(self, driver: RedisDriver) -> None:
        self._driver = driver
        self._pool: redis.ConnectionPool | None = None
        self._lock = threading.Lock()
        self._local = threading.local()
        #: Every connection made, to close them with the driver.
        self._made: list[Any] = []

    def _connection(self) -> tuple[Any, bool]:
        """This thread's connection, and whether it was used before (it may have been
        closed by the server since: a restart, a timeout, ``CLIENT KILL``)."""
        local = self._local
        conn = getattr(local, "conn", None)
        if conn is not None and local.pid == os.getpid():
            return conn, True
        with self._lock:
            if self._pool is None:
                node = self._driver.node
                options = dict(node.options)
                if not {"driver_info", "lib_name", "lib_version"} & set(options):
                    options.update(_NO_CLIENT_INFO)  # no CLIENT SETINFO per connection
                if "protocol" not in options:
                    options = _resp2(options)  # as the loop's connections (no HELLO)
                self._pool = redis.ConnectionPool.from_url(
                    node.url,
                    socket_timeout=node.socket_timeout,
                    socket_connect_timeout=node.connect_timeout,
                    decode_responses=False,
                    **options,
                )
            conn = self._pool.make_connection()
            self._made.append(conn)
        local.conn, local.pid = conn, os.getpid()
        return conn, False

    def _run(self, script: str, keys: tuple[bytes, ...], args: tuple[bytes, ...]) -> Any:
        conn, reused = self._connection()
        try:
            return self._call(conn, script, keys, args)
        except redis.exceptions.ConnectionError:
            if not reused:
                raise
            # A kept connection the server had closed: once more on a new one, rather than
            # fail the call (cheaper than polling the socket before every call). Both
            # scripts may run twice: an acquire by the same owner answers the lease it
            # holds, a release of a lease already released answers 0.
            return self._call(conn, script, keys, args)

    def _call(
        self, conn: Any, script: str, keys: tuple[bytes, ...], args: tuple[bytes, ...]
    ) -> Any:
        try:
            conn.send_packed_command([pack_script(script, keys, args)])
            try:
                return conn.read_response()
            except redis.exceptions.NoScriptError:
                # The server lost its script cache (a restart): the text loads it again.
                text = SCRIPTS[script].encode()
                conn.send_packed_command([pack(b"EVAL", text, b"%d" % len(keys), *keys, *args)])
                return conn.read_response()
        except BaseException:
            conn.disconnect()  # a call that did not end with its reply: reconnect next time
            raise

    def acquire(self, name: str, owner: str, ttl: float) -> int | None:
        driver = self._driver
        k = driver.keys(name)
        ttl_ms = ms(ttl)
        reply = self._run(
            "acquire",
            k.acquire_keys,
            (
                owner.encode(),
                b"%d" % ttl_ms,
                RESPECT_QUEUE if driver.fair else NO_QUEUE,
                k.channel,
                grace_ms(driver.restart_grace, ttl_ms),
                b"",  # no probe: this caller never waits in the queue
            ),
        )
        return int(reply[0]) if reply[0] else None

    def release(self, name: str, owner: str, token: int) -> bool:
        k = self._driver.keys(name)
        reply = self._run("release", k.release_keys, (owner.encode(), b"%d" % token, k.channel))
        return bool(reply)

    def close(self) -> None:
        with self._lock:
            made, self._made = self._made, []
        for conn in made:
            if conn.pid == os.getpid():
                conn.disconnect()
