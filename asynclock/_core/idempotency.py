"""Idempotency keys: ``async with backend.idempotent(key, ttl=...) as op:``.

The state machine lives here, once; a driver only stores records (``Driver.record_get``,
``record_put``, ``record_delete``) beside its leases. The record of a key is kept under the
key's lock name in asynclock's own namespace (``"\\x00asynclock.idempotency:" + key``, each
``/`` written as NUL: ``idempotency_rules.lock_name``; refused by ``lock()``), and is in one
of three states:

* ``running``: written (fenced) by the hold that runs the operation. Its lease is renewed
  by the backend's one session like any other; losing it cancels the body (G4). A running
  record whose lease is gone is abandoned: the next caller takes the name (a larger token)
  and runs the operation again.
* ``done`` / ``failed``: the result (or a failure the caller chose to store), written only
  while the writer's lease is the live one at the server, in the same atomic step as the
  check (G8): a holder presumed dead (frozen, partitioned) gets :class:`StaleToken` and
  cannot overwrite what its successor stored.

Every record expires ``keep`` seconds after its last write (the server forgets it). A done
or failed record is final: once ``save()`` has stored a result, nothing the body does after
it (an error, a stored failure) replaces or deletes it. What a key, a fingerprint and a
result may be is ``idempotency_rules.py`` (public as ``asynclock.idempotency``).
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, cast

import anyio
import anyio.lowlevel

from .context import ExcInfo
from .driver import Record
from .exceptions import (
    AcquireTimeout,
    AlreadyHeld,
    IdempotencyKeyReused,
    InProgress,
    LeaseLost,
    LockHeld,
    ReplayedFailure,
    RestartGrace,
    StaleToken,
)
from .idempotency_rules import DEFAULT_KEEP as DEFAULT_KEEP  # backend.py's default
from .idempotency_rules import (
    MAX_MESSAGE,
    KeyedCalls,
    arguments_of,
    check_keep,
    check_key,
    check_store_errors,
    encode_result,
    fingerprint_of,
    legacy_lock_name,
    lock_name,
)
from .lease import Lease
from .lock import Lock
from .misuse import AsyncContextOnly
from .validation import check_timeout

if TYPE_CHECKING:
    from .acquisition import Acquisition

logger = logging.getLogger("asynclock")
T = TypeVar("T")
P = ParamSpec("P")

_RUNNING, _DONE, _FAILED = "running", "done", "failed"


class _Flight:
    """One call of a key in this process that is taking or holding the key's lock: the
    process's other duplicates of the key (``wait=``) wait for it to end, then read the
    record once, instead of each waiting for the lock (every release would wake all of
    them to retry it: attempts grow with the square of the duplicates, a herd that swamped
    every backend at 250 duplicates of a key)."""

    __slots__ = ("done", "record", "task")

    def __init__(self, task: object) -> None:
        self.task = task
        self.done = anyio.Event()
        #: The record it stored or replayed (done or failed), for the waiters to replay
        #: without a read of their own.
        self.record: Record | None = None


#: Per backend (its acquisition): the key's lock name -> the flight in this process.
_flights: weakref.WeakKeyDictionary[Acquisition, dict[str, _Flight]] = weakref.WeakKeyDictionary()


def _payload(state: str, fingerprint: str | None, body: str = "null", **extra: str) -> str:
    # A one-line JSON header, a newline, then the result's JSON (never re-encoded).
    return json.dumps({"s": state, "f": fingerprint, **extra}, separators=(",", ":")) + "\n" + body


def _decode(record: Record) -> tuple[dict[str, Any], str]:
    head, _, body = record.payload.partition("\n")
    return json.loads(head), body


# -- one call -------------------------------------------------------------------------------


class IdempotentCall:
    """What ``async with backend.idempotent(...) as op:`` yields: one call of the operation.

    ``replayed`` is True when the operation completed before: ``result`` is its stored
    result (decoded from JSON), and the body must not do the work again. Otherwise this
    call runs it under a lease (``lease``, fencing token ``token``) that is cancelled when
    lost, and stores its result with :meth:`save`.
    """

    __slots__ = ("_guard", "_rejected", "_saved", "key", "lease", "replayed", "result", "token")

    def __init__(
        self, guard: Idempotent, lease: Lease | None, replayed: bool, result: object, token: int
    ) -> None:
        self._guard = guard
        self.key: str = guard.key
        self.lease = lease
        self.replayed = replayed
        self.result: Any = result
        #: The fencing token of this call's hold, or (replayed) of the one that stored it.
        self.token = token
        self._saved = False
        self._rejected: BaseException | None = None

    def __repr__(self) -> str:
        state = "replayed" if self.replayed else "saved" if self._saved else "running"
        return f"<IdempotentCall {self.key!r} token={self.token} {state}>"

    @property
    def saved(self) -> bool:
        return self._saved

    async def save(self, result: object) -> None:
        """Store ``result`` as the operation's result, fenced by this call's token.

        Once it returns, the result is the operation's for good: an error the body raises
        after it is raised to this caller, and later calls replay the saved result.

        Raises:
            TypeError, ValueError: JSON cannot hold ``result`` as it is (a type it has no
                form for, a dict key that is not a str, NaN), it nests deeper than 100
                levels, or it is larger than 64 KiB as JSON; nothing is stored. Unless a
                later ``save()`` stores something, the key is freed when the block ends,
                however it ends (a retry runs the operation): never a stored ``None``.
            StaleToken: this call's lease is no longer the live one at the server (it
                expired while this process was frozen or cut off; another call may have
                run the operation since): nothing is stored, and the lease counts as lost
                (the body is cancelled at its next await; the ``async with`` raises
                :class:`LeaseLost`).
            LeaseLost: more often, for a call frozen past its ttl: when the process
                resumes, its lease is past its local deadline and lost before the write
                reaches the server, the body (this ``save()`` with it) is cancelled and the
                ``async with`` raises ``LeaseLost``. Nothing is stored either way.
            RuntimeError: the call was replayed, or its result is saved already.
        """
        if self.replayed or self.lease is None:
            raise RuntimeError(f"idempotent operation {self.key!r} was replayed: nothing to save")
        if self._saved:
            raise RuntimeError(f"the result of idempotent operation {self.key!r} is saved already")
        try:
            body = encode_result(self.key, result)
        except (TypeError, ValueError) as exc:
            self._rejected = exc  # never stored as a failure (store_errors): a retry runs
            raise
        # A body whose lease is lost is cancelled here, before anything is sent, even on a
        # driver whose write starts without yielding (SQLite): the documented LeaseLost.
        await anyio.lowlevel.checkpoint_if_cancelled()
        guard = self._guard
        payload = _payload(_DONE, guard.fingerprint, body)
        if not await guard.put(self.lease, payload) and not await guard.stored(self.token, payload):
            # The server says the lease is not live: it is lost, as when a renewal is
            # refused (G4): the body is cancelled at its next await, and the `async with`
            # raises LeaseLost even if the body swallows this StaleToken.
            guard.lose(
                self.lease,
                "the fenced write of the result was refused: the lease is no longer live "
                "at the server",
            )
            raise StaleToken(self.key, self.token, None)
        self._saved = True
        self._rejected = None
        self.result = result
        guard.final = Record(self.token, payload)


# -- the guard --------------------------------------------------------------------------------


class Idempotent(AsyncContextOnly):
    """``async with backend.idempotent(key, ttl=...) as op:`` — see
    :meth:`Backend.idempotent`. One ``async with`` at a time: make one per call (cheap)."""

    _usage = "backend.idempotent(...)"

    def __init__(
        self,
        acq: Acquisition,
        key: str,
        ttl: float,
        fingerprint: object,
        keep: float,
        wait: float | None,
        store_errors: object,
    ) -> None:
        self.key = check_key(key)
        self.fingerprint = fingerprint_of(fingerprint)
        self.keep = check_keep(keep)
        self.wait = check_timeout(wait)
        if self.wait is not None and self.wait <= 0:
            self.wait = None  # no time to wait: answer at once
        self.store_errors = check_store_errors(store_errors)
        self._acq = acq
        self._name = lock_name(self.key)
        self._legacy = legacy_lock_name(self.key)
        self._ttl = ttl
        self._lock = Lock(
            acq, self._name, ttl, self.wait, self.wait is not None, None, internal=True
        )
        self._call: IdempotentCall | None = None
        self._flight: _Flight | None = None
        #: The done or failed record this call stored or replayed, for its flight's waiters.
        self.final: Record | None = None

    def __repr__(self) -> str:
        return f"<asynclock.Idempotent {self.key!r}>"

    # -- driver calls ------------------------------------------------------------------------

    async def _get(self) -> Record | None:
        record = await self._read(self._name)
        if record is None and self._legacy is not None:
            # Earlier builds kept a key with "/" under its raw name (where key "a" and key
            # "a/b" met on etcd): a finished record there is still the key's outcome.
            old = await self._read(self._legacy)
            if old is not None and _decode(old)[0].get("s") in (_DONE, _FAILED):
                return old
        return record

    async def _read(self, name: str) -> Record | None:
        acq = self._acq
        found = await acq.call("record_get", acq.driver.record_get(name), (NotImplementedError,))
        return cast("Record | None", found)

    async def put(self, lease: Lease, payload: str) -> bool:
        acq = self._acq
        call = acq.driver.record_put(self._name, lease.owner, lease.token, payload, self.keep)
        return bool(await acq.call("record_put", call))

    async def stored(self, token: int, payload: str) -> bool:
        """Is ``payload`` the record of ``token`` already? (A driver that repeats a write
        whose answer was lost sees its own earlier write as a refusal.)"""
        record = await self._get()
        return record is not None and record.token == token and record.payload == payload

    def lose(self, lease: Lease, reason: str) -> None:
        self._acq.session.lose(lease, reason)

    async def _forget(self, token: int) -> None:
        """Delete our running record (a retryable failure): best effort, shielded and bounded;
        a record left behind is abandoned anyway once the lease is released."""
        acq = self._acq
        with anyio.CancelScope(shield=True), anyio.move_on_after(acq.bounds.timeout):
            try:
                await acq.call("record_delete", acq.driver.record_delete(self._name, token))
            except Exception as exc:
                logger.warning("idempotency key %r: its record was not deleted: %r", self.key, exc)

    # -- states ------------------------------------------------------------------------------

    def _replay(self, record: Record) -> IdempotentCall | None:
        """What a found record means for this call: a replay (done), a raise (failed, or
        another fingerprint), or None (running: the operation is not finished)."""
        head, body = _decode(record)
        if self.fingerprint is not None and head.get("f") != self.fingerprint:
            raise IdempotencyKeyReused(self.key)
        state = head.get("s")
        if state in (_DONE, _FAILED):
            self.final = record  # for this call's flight's waiters, if it is one
        if state == _DONE:
            return IdempotentCall(self, None, True, json.loads(body), record.token)
        if state == _FAILED:
            raise ReplayedFailure(self.key, str(head.get("t")), str(head.get("m")))
        return None

    async def __aenter__(self) -> IdempotentCall:
        if self._call is not None:
            raise RuntimeError(
                f"backend.idempotent({self.key!r}) is already entered; use one `async with` "
                "at a time (call backend.idempotent(...) once per call)"
            )
        self._acq.ready()
        if self.wait is None:
            record = await self._get()
            call = None if record is None else self._replay(record)
        else:
            call = await self._join_or_fly()
        if call is not None:
            self._call = call
            return call
        try:
            return await self._enter()
        except BaseException:
            self._land()
            raise

    async def _join_or_fly(self) -> IdempotentCall | None:
        """Wait (up to ``wait``) while another call of this key in this process takes or
        holds its lock, replaying what it stored (or reading the record) each time one
        ends; else become this process's flight and take the lock ourselves (None)."""
        assert self.wait is not None
        flights = _flights.setdefault(self._acq, {})
        task = self._acq.current_task()
        deadline = anyio.current_time() + self.wait
        while (flight := flights.get(self._name)) is not None and flight.task != task:
            with anyio.move_on_after(deadline - anyio.current_time()):
                await flight.done.wait()
            record = flight.record if flight.done.is_set() else await self._get()
            if record is not None and (call := self._replay(record)) is not None:
                return call
            if not flight.done.is_set():
                raise InProgress(self.key, self.wait)
        if flight is not None:
            return None  # our own: the lock says AlreadyHeld
        # This process's flight from here (its duplicates wait for it), reading first.
        self._flight = flights[self._name] = _Flight(task)
        try:
            record = await self._get()
            call = None if record is None else self._replay(record)
        except BaseException:
            self._land()
            raise
        if call is not None:
            self._land()
            return call
        left = deadline - anyio.current_time()
        if left < self.wait:
            self._lock = Lock(self._acq, self._name, self._ttl, max(left, 0.0), True, None,
                              internal=True)  # fmt: skip
        return None

    def _land(self) -> None:
        """End this call's flight (if it is one): the process's duplicates read the record."""
        flight, self._flight = self._flight, None
        if flight is not None:
            flight.record = self.final
            flights = _flights.get(self._acq)
            if flights is not None and flights.get(self._name) is flight:
                del flights[self._name]
            flight.done.set()

    async def _enter(self) -> IdempotentCall:
        lock = self._lock
        try:
            lease = await lock.__aenter__()
        except (LockHeld, AcquireTimeout) as exc:
            if isinstance(exc, (AlreadyHeld, RestartGrace)):
                raise  # our own hold of the key; a server that grants nothing yet
            # Finished meanwhile, or another request under this key?
            record = await self._get()
            if record is not None and (call := self._replay(record)) is not None:
                self._land()
                self._call = call
                return call
            raise InProgress(self.key, self.wait) from None
        try:
            record = await self._get()
            call = None if record is None else self._replay(record)
            if call is None:
                running = _payload(_RUNNING, self.fingerprint)
                if not await self.put(lease, running):
                    raise LeaseLost(self._name, lease.token, "the lease was not live at the server")
                call = IdempotentCall(self, lease, False, None, lease.token)
        except BaseException as exc:
            await lock.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        if call.replayed:  # it finished while we waited for the lease
            await lock.__aexit__(None, None, None)
            self._land()
        self._call = call
        return call

    async def __aexit__(self, *exc_info: *ExcInfo) -> bool:
        call, self._call = self._call, None
        assert call is not None, "Idempotent.__aexit__ without __aenter__"
        if call.replayed:
            return False
        lease = call.lease
        assert lease is not None
        exc = exc_info[1]
        try:
            if lease.lost.reason is None and not call.saved:  # a saved result is final
                if exc is None and call._rejected is None:
                    await call.save(None)  # finished without a result: None
                elif exc is None:
                    # Its result was refused (save() raised TypeError/ValueError, which the
                    # body caught) and nothing else saved: storing None would replay an
                    # answer the operation never gave. The key is freed: a retry runs it.
                    await self._forget(lease.token)
                elif (
                    isinstance(exc, self.store_errors)
                    and exc is not call._rejected
                    and not isinstance(exc, StaleToken)
                ):
                    failed = _payload(
                        _FAILED,
                        self.fingerprint,
                        t=f"{type(exc).__module__}.{type(exc).__qualname__}",
                        m=str(exc)[:MAX_MESSAGE],
                    )
                    with anyio.CancelScope(shield=True):
                        if await self.put(lease, failed):
                            self.final = Record(lease.token, failed)
                else:
                    await self._forget(lease.token)
        except BaseException as err:
            try:
                await self._lock.__aexit__(type(err), err, err.__traceback__)
            finally:
                self._land()
            raise
        try:
            return await self._lock.__aexit__(*exc_info)
        finally:
            self._land()

    async def run(self, fn: Callable[..., Awaitable[T]], /, *args: Any, **kwargs: Any) -> T:
        """``await fn(*args, **kwargs)`` once for this key: its result is stored and
        returned; a later call returns the stored result (decoded from JSON) instead."""
        async with self as op:
            if op.replayed:
                return cast("T", op.result)
            result = await fn(*args, **kwargs)
            await op.save(result)
            return result
        raise AssertionError("unreachable: a lost lease raises LeaseLost")  # pragma: no cover


def idempotent_function(
    idempotent: Callable[..., Idempotent],
    key: str,
    fingerprint: Sequence[str] | None,
    options: dict[str, Any],
) -> Callable[[Callable[P, Awaitable[T]]], Callable[P, Coroutine[Any, Any, T]]]:
    """:meth:`Backend.idempotent_function` (see there): ``idempotent`` is the backend's."""
    calls = KeyedCalls.declare(key, fingerprint=fingerprint, keep=options["keep"])
    # The other options are checked now too, not at the first call.
    idempotent("key", **options)

    def decorate(func: Callable[P, Awaitable[T]]) -> Callable[P, Coroutine[Any, Any, T]]:
        if not inspect.iscoroutinefunction(func):
            raise TypeError(
                "idempotent_function needs an `async def` function; "
                f"{getattr(func, '__qualname__', func)!s} is not one"
            )
        calls.check_function(func)

        @functools.wraps(func)
        async def idempotent_call(*args: P.args, **kwargs: P.kwargs) -> T:
            arguments = arguments_of(func, args, kwargs)
            guard = idempotent(
                calls.key(arguments), fingerprint=calls.fingerprint_of(arguments), **options
            )
            return await guard.run(func, *args, **kwargs)

        idempotent_call.__signature__ = inspect.signature(func)  # type: ignore[attr-defined]
        return idempotent_call

    return decorate
