"""A minimal etcd v3 client over ``grpc.aio``: the few calls the lock needs, each bounded.

Why our own instead of a library (see docs/backends/etcd.md): every call here has a
deadline, nothing is retried behind our back (a retried acquire could land twice), the
keep-alives of every lease share one long-lived stream, and the state of a lease is what
the server last acknowledged — never a flag a library keeps.

No grpc.aio awaitable is awaited directly (grpc/grpc#43502): see ``_grpc.py``.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import grpc
import grpc.aio

from ..._core.errors import map_errors
from ..._core.exceptions import BackendUnavailable
from . import _proto as pb
from ._grpc import serialize, settle, wait_call, wait_done
from ._keepalive import KeepAlives
from ._stream import Stream
from ._target import new_channel, resolve

logger = logging.getLogger("asynclock.etcd")

#: etcd's server-side interceptor cancels a stream carrying this when its member has no
#: leader, so an isolated member cannot keep a lease alive by silence.
REQUIRE_LEADER = ("hasleader", "true")
#: How long closing waits for the calls it cancelled to end (see :meth:`EtcdClient.aclose`).
CLOSE_WAIT = 15.0


@dataclass(frozen=True)
class TLS:
    """Client TLS: CA bundle to trust (None: the system's), optional client certificate."""

    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None
    server_name: str | None = None


@dataclass
class Endpoints:
    hosts: list[tuple[str, int]]
    tls: TLS | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)


class EtcdError(BackendUnavailable):
    """An etcd call failed; ``code`` is the gRPC status code name (``UNAVAILABLE``, …)."""

    _fields = ("message", "code")  # rebuilt from both when unpickled

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class EtcdClient:
    """One channel to the cluster (grpc fails over between the endpoints), two streams."""

    def __init__(self, endpoints: Endpoints, *, timeout: float, display: str = "etcd") -> None:
        self.endpoints = endpoints
        self.timeout = timeout
        #: grpc's errors in words, named after the backend, the password scrubbed.
        self.errors = map_errors(display, endpoints.password, explain=_explain)
        self._channel: grpc.aio.Channel | None = None
        self._token: str | None = None
        self._unary: dict[str, Callable[..., Any]] = {}
        self._keepalives = KeepAlives(self)
        self._watch_stream = Stream(
            self, "/etcdserverpb.Watch/Watch", pb.WatchResponse, self._on_watch, self._fail_watches
        )
        self._watch_ids = itertools.count(1)
        self._watches: dict[int, Callable[[str, int, bytes], None]] = {}
        self._catching_up: list[_CaughtUp] = []
        self.on_watch_reset: Callable[[], None] = lambda: None
        #: Every call (unary or stream) not yet done: closing cancels them and waits for
        #: each to end, since grpc delivers a completion to the loop the call came from,
        #: and one that arrives after that loop closed breaks the next loop grpc serves.
        self._calls: set[Any] = set()
        #: Stream reads and writes in flight (tasks): closing waits for them, since a
        #: completion that arrives after its event loop closed breaks the next loop grpc
        #: serves.
        self.inflight: set[asyncio.Future[Any]] = set()
        #: How often each stream was opened (by method name): 1 unless one broke.
        self.streams_opened: dict[str, int] = {"LeaseKeepAlive": 0, "Watch": 0}
        self._addresses: list[str] = []
        self._options: list[tuple[str, Any]] = []
        self._retired: list[tuple[float, grpc.aio.Channel]] = []
        self._rotated_at = -math.inf
        #: How often the client moved to the next member (see _failed_over).
        self.failovers = 0

    # -- lifecycle -------------------------------------------------------------------------

    async def open(self) -> None:
        self._addresses, self._options = await resolve(
            self.endpoints, self.timeout, self.errors.display
        )
        self._channel = new_channel(self._addresses, self._options, self.endpoints.tls)
        try:
            if self.endpoints.user is not None:
                await self._authenticate()
            await self.status()  # fail now, with a clear message, if nothing answers
        except BaseException:
            await self.aclose()  # the backend never opened: nobody else will close it
            raise

    def _failed_over(self, code: str) -> None:
        """A call through the member in use timed out or found it unavailable: a member
        that is up but cut off from the others (or frozen) keeps its connection, so grpc
        would stay on it; put the next member first (at most once per call timeout)."""
        if code not in ("UNAVAILABLE", "DEADLINE_EXCEEDED") or len(self._addresses) < 2:
            return
        now = time.monotonic()
        if now - self._rotated_at < self.timeout or self._channel is None:
            return
        self._rotated_at = now
        self._addresses = self._addresses[1:] + self._addresses[:1]
        self._retired.append((now, self._channel))
        self._channel = new_channel(self._addresses, self._options, self.endpoints.tls)
        self._unary.clear()
        self.failovers += 1
        logger.info("%s: failing over to %s", self.errors.display, self._addresses[0])
        self._keepalives.stream.reset()  # the streams reopen on the new channel
        self._watch_stream.reset()

    async def close_retired(self, older_than: float) -> None:
        keep: list[tuple[float, grpc.aio.Channel]] = []
        for at, channel in self._retired:
            if at <= older_than:
                with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
                    await settle(channel.close(grace=None))
            else:
                keep.append((at, channel))
        self._retired = keep

    async def aclose(self) -> None:
        channel, self._channel = self._channel, None
        self._unary.clear()
        with anyio.CancelScope(shield=True):
            # Every call and every stream read and write ends before the loop does: grpc
            # delivers a late completion to the loop its call came from, even a closed one,
            # and the next loop it serves then fails ("Event loop is closed"). A cancelled
            # call always completes; only a loaded machine makes it slow, so the bound is
            # generous and running out of it is logged.
            for call in list(self._calls):
                call.cancel()
            with anyio.move_on_after(CLOSE_WAIT) as waiting:
                for task in list(self.inflight):
                    await wait_done(task)
                for call in list(self._calls):
                    await wait_call(call)
            if waiting.cancelled_caught:
                logger.warning(
                    "%s: %d call(s) still not ended %.0f s after closing; a late completion "
                    "may reach a closed event loop",
                    self.errors.display,
                    len(self._calls) + sum(not t.done() for t in self.inflight),
                    CLOSE_WAIT,
                )
        await self.close_retired(math.inf)
        with anyio.CancelScope(shield=True):
            # Closed even if those waits ran out: an open channel keeps grpc's poller bound
            # to this loop, and the next loop's callbacks then fail the same way.
            if channel is not None:
                with anyio.move_on_after(CLOSE_WAIT):
                    await settle(channel.close(grace=None))
        # grpc keeps its poller (a thread, bound to this loop) while any channel or call
        # object is alive, and ours are kept alive by reference cycles (tracebacks, task
        # closures) until the garbage collector runs. A process that opens a new loop
        # first (every test of a suite, asyncio.run twice) would then get this loop's late
        # completions delivered to it: "Event loop is closed". Collect now, so the poller
        # ends with this loop (it does when no other grpc object is alive in the process).
        del channel
        self._calls.clear()
        gc.collect()

    def _error(self, path: str, exc: grpc.aio.AioRpcError) -> EtcdError:
        """``exc`` through the one error mapper, keeping grpc's status code name."""
        code = exc.code()
        what = path.rsplit("/", 1)[-1]
        message = str(self.errors.unavailable(f"{what} failed", exc))
        return EtcdError(message, code.name if code is not None else "UNKNOWN")

    # -- unary calls -----------------------------------------------------------------------

    def _method(self, path: str, response: Any) -> Callable[..., Any]:
        method = self._unary.get(path)
        if method is None:
            if self._channel is None:
                raise BackendUnavailable(f"{self.errors.display}: the client is closed")
            method = self._channel.unary_unary(
                path,
                request_serializer=serialize,
                response_deserializer=response.FromString,
            )
            self._unary[path] = method
        return method

    def _metadata(self, *extra: tuple[str, str]) -> tuple[tuple[str, str], ...] | None:
        md = extra if self._token is None else (("token", self._token), *extra)
        return md or None

    async def call(
        self, path: str, request: Any, response: Any, *, timeout: float | None = None
    ) -> Any:
        """One unary call with a deadline; grpc errors become :class:`EtcdError`."""
        try:
            return await self._call_once(path, request, response, timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED and self.endpoints.user:
                # The auth token expired: the server refused without running the request,
                # so asking again with a fresh token cannot apply it twice.
                await self._authenticate()
                try:
                    return await self._call_once(path, request, response, timeout)
                except grpc.aio.AioRpcError as again:
                    raise self._error(path, again) from again
            error = self._error(path, exc)
            self._failed_over(error.code)
            raise error from exc

    async def _call_once(
        self, path: str, request: Any, response: Any, timeout: float | None
    ) -> Any:
        method = self._method(path, response)
        call = method(request, timeout=timeout or self.timeout, metadata=self._metadata())
        self._track(call)
        done = anyio.Event()
        call.add_done_callback(lambda _c: done.set())
        try:
            await done.wait()
        except BaseException:
            call.cancel()
            raise
        return await call  # done: returns (or raises AioRpcError) without suspending

    async def _authenticate(self) -> None:
        self._token = None
        request = pb.AuthenticateRequest(
            name=self.endpoints.user, password=self.endpoints.password or ""
        )
        try:
            reply = await self._call_once(
                "/etcdserverpb.Auth/Authenticate", request, pb.AuthenticateResponse, None
            )
        except grpc.aio.AioRpcError as exc:
            raise self._error("authenticate", exc) from exc
        self._token = reply.token

    async def range(self, request: Any) -> Any:
        return await self.call("/etcdserverpb.KV/Range", request, pb.RangeResponse)

    async def txn(self, request: Any) -> Any:
        return await self.call("/etcdserverpb.KV/Txn", request, pb.TxnResponse)

    async def delete(self, key: bytes) -> Any:
        request = pb.DeleteRangeRequest(key=key)
        return await self.call("/etcdserverpb.KV/DeleteRange", request, pb.DeleteRangeResponse)

    async def grant(self, ttl: int) -> Any:
        request = pb.LeaseGrantRequest(TTL=ttl)
        return await self.call("/etcdserverpb.Lease/LeaseGrant", request, pb.LeaseGrantResponse)

    async def revoke(self, lease_id: int) -> None:
        request = pb.LeaseRevokeRequest(ID=lease_id)
        await self.call("/etcdserverpb.Lease/LeaseRevoke", request, pb.LeaseRevokeResponse)

    async def time_to_live(self, lease_id: int, *, keys: bool) -> Any:
        request = pb.LeaseTimeToLiveRequest(ID=lease_id, keys=keys)
        path = "/etcdserverpb.Lease/LeaseTimeToLive"
        return await self.call(path, request, pb.LeaseTimeToLiveResponse)

    async def status(self) -> Any:
        path = "/etcdserverpb.Maintenance/Status"
        return await self.call(path, pb.StatusRequest(), pb.StatusResponse)

    async def compact(self, revision: int) -> None:
        request = pb.CompactionRequest(revision=revision, physical=True)
        await self.call("/etcdserverpb.KV/Compact", request, pb.CompactionResponse)

    # -- keep-alive stream -----------------------------------------------------------------

    async def keep_alive(self, lease_ids: Sequence[int]) -> dict[int, int]:
        """One keep-alive per lease on the shared stream; the TTL each ack carries (<= 0:
        the lease is gone). Raises if an ack does not come within the call timeout."""
        waiters = self._keepalives.send(lease_ids)
        try:
            with anyio.fail_after(self.timeout):
                return await self._keepalives.acks(waiters)
        except TimeoutError:
            # No answer within the deadline: the stream may be dead without knowing it
            # (a blackholed connection); open a fresh one for the next round.
            self._keepalives.stream.reset()
            self._failed_over("DEADLINE_EXCEEDED")
            raise EtcdError(
                f"{self.errors.display}: keep-alive not acknowledged in time", "DEADLINE_EXCEEDED"
            ) from None

    async def run_keepalive_stream(self) -> None:
        await self._keepalives.stream.run()

    @property
    def acked_revision(self) -> int:
        """The highest store revision a keep-alive ack carried: read after a keep-alive's
        ack, the server's revision when it answered, or later."""
        return self._keepalives.revision

    # -- watch stream ----------------------------------------------------------------------

    def watch(
        self,
        key: bytes,
        start_revision: int,
        callback: Callable[[str, int, bytes], None],
        *,
        range_end: bytes = b"",
    ) -> int:
        """Watch ``key`` (every key up to ``range_end``, if given) for deletions from
        ``start_revision`` on: ``callback("created", revision, b"")`` once the server has
        it, ``callback("deleted", revision, key)`` for each deletion,
        ``callback("canceled", compact_revision, b"")`` when the server drops the watch
        (compacted history; 0: refused). Returns the watch id for :meth:`cancel_watch`."""
        watch_id = next(self._watch_ids)
        self._watches[watch_id] = callback
        create = pb.WatchCreateRequest(
            key=key,
            range_end=range_end,
            start_revision=start_revision,
            watch_id=watch_id,
            filters=[0],  # NOPUT: deletions only
        )
        self._watch_stream.send(pb.WatchRequest(create_request=create))
        return watch_id

    def cancel_watch(self, watch_id: int) -> None:
        if self._watches.pop(watch_id, None) is not None:
            cancel = pb.WatchCancelRequest(watch_id=watch_id)
            self._watch_stream.send(pb.WatchRequest(cancel_request=cancel))

    async def run_watch_stream(self) -> None:
        await self._watch_stream.run()

    async def watches_caught_up(self, revision: int, within: float) -> bool:
        """Has the watch stream delivered every event of its watches up to ``revision``?

        One progress request, whatever the number of watches: True once a progress
        notification at ``revision`` or later arrives within ``within`` seconds; False if
        none does (the stream broke, or the server holds it back while a watch is still
        catching up on history). etcd before 3.5.8 (3.4.24) answers at once, even ahead
        of events it is still sending (etcd-io/etcd#15220): there an event of a watch is
        seen when it arrives, normally within milliseconds of the answer.
        """
        waiter = _CaughtUp(revision)
        self._catching_up.append(waiter)
        self._watch_stream.send(pb.WatchRequest(progress_request=pb.WatchProgressRequest()))
        try:
            with anyio.move_on_after(within):
                await waiter.event.wait()
        finally:
            if waiter in self._catching_up:
                self._catching_up.remove(waiter)
        return waiter.ok

    def _on_watch(self, reply: Any) -> None:
        if reply.watch_id == -1 and not (reply.created or reply.canceled or reply.events):
            # A progress notification: every event up to its revision has been sent.
            revision = reply.header.revision
            for waiter in [w for w in self._catching_up if w.revision <= revision]:
                self._catching_up.remove(waiter)
                waiter.ok = True
                waiter.event.set()
            return
        callback = self._watches.get(reply.watch_id)
        if callback is None:
            return
        if reply.created and not reply.canceled:
            callback("created", reply.header.revision, b"")
        for event in reply.events:
            if event.type == pb.EVENT_DELETE:
                callback("deleted", event.kv.mod_revision, event.kv.key)
        if reply.canceled:
            self._watches.pop(reply.watch_id, None)
            callback("canceled", reply.compact_revision, b"")

    def _fail_watches(self, error: BaseException) -> None:
        # The server forgets every watch of a broken stream: the owners start again from
        # a fresh look at the keys (the driver retries its attempts).
        self._watches.clear()
        waiting, self._catching_up = self._catching_up, []
        for waiter in waiting:
            waiter.event.set()  # not caught up: the events it waited for may be lost
        self.on_watch_reset()

    # -- the streams' calls (see _stream.py) ----------------------------------------------

    def open_stream(self, path: str, response: Any) -> Any:
        """A new call of the stream ``path`` on the channel in use (None: the client is
        closed); closing the client waits for it to end."""
        if self._channel is None:
            return None
        method = self._channel.stream_stream(
            path, request_serializer=serialize, response_deserializer=response.FromString
        )
        call = method(metadata=self._metadata(REQUIRE_LEADER))
        what = path.rsplit("/", 1)[-1]
        self.streams_opened[what] = self.streams_opened.get(what, 0) + 1
        self._track(call)
        return call

    def _track(self, call: Any) -> None:
        self._calls.add(call)
        call.add_done_callback(self._calls.discard)

    @property
    def calls_pending(self) -> int:
        """Calls started and not yet ended (0 once :meth:`aclose` returns)."""
        return len(self._calls)

    def stream_error(self, path: str, cause: BaseException | None) -> EtcdError:
        """Why the stream ``path`` broke: ``cause`` (None: the server ended it)."""
        if cause is None:
            return EtcdError(f"{self.errors.display}: {path} stream ended", "UNAVAILABLE")
        if isinstance(cause, grpc.aio.AioRpcError):
            return self._error(path, cause)
        return EtcdError(
            self.errors.scrub(f"{self.errors.display}: {path} stream broke: {cause!r}"),
            "UNAVAILABLE",
        )


class _CaughtUp:
    """One wait for the watch stream's progress to reach ``revision``."""

    __slots__ = ("event", "ok", "revision")

    def __init__(self, revision: int) -> None:
        self.revision = revision
        self.event = anyio.Event()
        self.ok = False


def _explain(exc: BaseException) -> str | None:
    if isinstance(exc, grpc.aio.AioRpcError):
        code = exc.code()
        return f"{code.name if code is not None else 'UNKNOWN'}: {exc.details()}"
    return None


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that makes a range cover every key starting with ``prefix``."""
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\x00"


__all__ = ("TLS", "EtcdClient", "EtcdError", "Endpoints", "prefix_end")
