"""Backend: the facade users open and call. It composes a driver, a :class:`Session` (every held
lease's life) and an :class:`Acquisition` (acquire, wait, release), opens and closes them,
and offers the public API. ``Lock``, ``Lease`` and ``Leadership`` use the acquisition's
small internal protocol, never a private member of the backend."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection, Coroutine
from typing import TYPE_CHECKING, Any, ParamSpec, Self, TypeVar, cast

import anyio
import anyio.abc

from .acquisition import Acquisition
from .advice import DEFAULT_MAX_TEMPLATES, Advice, AdviceCollector, default_name_template
from .bounds import CallBounds
from .clock import Clock, MonotonicClock
from .context import ExcInfo
from .driver import Driver
from .holder import Holder
from .holds import Holds
from .idempotency import DEFAULT_KEEP, Idempotent, idempotent_function
from .leadership import Leader, Leadership, find_leader
from .lease import Lease
from .listing import list_holders
from .lock import Lock, locked_function
from .lock_all import LocksAll
from .misuse import AsyncContextOnly
from .observer import Fanout, Observer
from .owner_label import check_owner_label
from .partitions import PartitionsMixin
from .rwlock import RWLocks
from .semaphore import Semaphores
from .session import Session
from .stats import BackendStats, StatsRecorder
from .validation import check_name, check_timing, check_token

if TYPE_CHECKING:
    from .claims import Claims

logger = logging.getLogger("asynclock")
T = TypeVar("T")
P = ParamSpec("P")


class Backend(Semaphores, RWLocks, LocksAll, PartitionsMixin, AsyncContextOnly):
    """A lock service: hand out leases on names, renew them, and stop holders that lose them.
    Create one with :func:`asynclock.connect` (or pass a driver) and use it as an async
    context manager; it owns the background renewer of every lease it grants.

    Args:
        driver: the backend driver (see ``asynclock.backends``).
        clock: monotonic clock used for deadlines (default ``time.monotonic``).
        drift: clock-rate allowance as a fraction of ttl (default 1 %).
        margin: seconds taken off every local deadline (default 5 ms).
        heartbeat: renew every ``ttl * heartbeat`` seconds (default 1/3).
        release_timeout: bound on a release or on the clean-up of an interrupted acquire.
        owner_label: what this process calls itself in its leases (default ``host:pid``;
            1 to 100 bytes of printable UTF-8), read by others as :attr:`Holder.label`.
    """

    _usage = "asynclock.connect(url)"

    def __init__(
        self,
        driver: Driver,
        *,
        clock: Clock | None = None,
        drift: float = 0.01,
        margin: float = 0.005,
        heartbeat: float = 1 / 3,
        release_timeout: float = 5.0,
        owner_label: str | None = None,
    ) -> None:
        if not isinstance(driver, Driver):
            raise TypeError(f"driver must be an asynclock Driver, not {type(driver).__name__}")
        check_timing(drift, margin, heartbeat, release_timeout)
        label = check_owner_label(owner_label)
        self.driver = driver
        self.clock: Clock = clock or MonotonicClock()
        self.drift, self.margin, self.heartbeat = drift, margin, heartbeat
        self._bounds = bounds = CallBounds(self.clock, release_timeout)
        timing = (StatsRecorder(), drift, margin, heartbeat, driver.display)
        self._session = session = Session(self.clock, bounds, *timing)
        self._acq = acq = Acquisition(driver, session, self.clock, bounds, label)
        self._tg: anyio.abc.TaskGroup | None = None
        self._advice: AdviceCollector | None = None
        driver.bind(self.clock, acq.wake, session.lost_out_of_band, session.renew_soon)

    def __repr__(self) -> str:
        return f"<asynclock.Backend {self.driver.display} held={len(self._session.live())}>"

    # -- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        acq, session = self._acq, self._session
        if acq.open:
            raise RuntimeError("this backend is already open; use one `async with` per backend")
        acq.bind_loop()
        await self.driver.open()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        acq.open = True
        self._tg.start_soon(self.driver.background, name=f"asynclock {self.driver.display}")
        self._tg.start_soon(session.renew_loop, name="asynclock renewer")
        self._tg.start_soon(session.watchdog_loop, name="asynclock watchdog")
        self._tg.start_soon(self._bounds.run, name="asynclock release deadlines")
        return self

    async def __aexit__(self, *exc_info: *ExcInfo) -> bool | None:
        acq = self._acq
        await acq.close()
        assert self._tg is not None
        self._tg.cancel_scope.cancel()
        # Hand the task group only a cancellation (it may be its own, from a crashed
        # background task): anything else the body raised propagates unwrapped.
        cancelled = isinstance(exc_info[1], anyio.get_cancelled_exc_class())
        try:
            if cancelled:
                return await self._tg.__aexit__(*exc_info)
            await self._tg.__aexit__(None, None, None)
            return None
        finally:
            acq.unbind_loop()
            with anyio.CancelScope(shield=True):
                await self.driver.aclose()

    @property
    def owner_label(self) -> str:
        """This process's owner label (default ``host:pid``), carried in lease owners."""
        return self._acq.label

    @property
    def release_timeout(self) -> float:
        """Bound (seconds) on a release or on the clean-up of an interrupted acquire."""
        return self._bounds.timeout

    # -- public API ------------------------------------------------------------------------

    def lock(
        self,
        name: str,
        *,
        ttl: float,
        timeout: float | None = None,
        blocking: bool = True,
        max_hold: float | None = None,
        token_scope: str | None = None,
    ) -> Lock:
        """An async context manager that holds ``name`` for the body and yields the Lease.

        The body runs in a cancel scope cancelled when the lease is lost; the ``async with``
        then raises :class:`LeaseLost`. Busy with ``blocking=False``: :class:`LockHeld`;
        not acquired within ``timeout``: :class:`AcquireTimeout`; inside this task's own
        hold of ``name`` (a lock or a term): :class:`AlreadyHeld` at once (not re-entrant).
        ``token_scope`` (validated like a name): the token is also above every earlier
        token of that scope (G2 per scope), for a job locking a name per occurrence.
        """
        return Lock(self._acq, name, ttl, timeout, blocking, max_hold, token_scope)

    def _templated_lock(
        self,
        name: str,
        *,
        ttl: float,
        timeout: float | None,
        blocking: bool,
        max_hold: float | None,
        template: str,
    ) -> Lock:
        """:meth:`lock` for a lock made from ``template`` (``locked_function``)."""
        return Lock(self._acq, name, ttl, timeout, blocking, max_hold, template=template)

    async def acquire(
        self,
        name: str,
        *,
        ttl: float,
        timeout: float | None = None,
        blocking: bool = True,
        max_hold: float | None = None,
        token_scope: str | None = None,
    ) -> Lease:
        """Acquire without a context manager. You must ``await lease.release()``. No cancel
        scope guards your work: watch ``lease.lost`` or call ``lease.check()`` before side
        effects, and fence writes with ``lease.token``. Otherwise as :meth:`lock`."""
        return await self._acq.acquire_checked(name, ttl, timeout, blocking, max_hold, token_scope)

    async def validate(self, name: str, token: int) -> bool:
        """True if ``token`` is the live holder's token for ``name`` right now (G9); False
        for a token that was a holder's but is not the live one. A ``TypeError`` for a
        token that is not an int, a ``ValueError`` for one no lease can have (not in
        1 .. 2**63-1): check a token from outside (a header, a message) first, as fences do.
        """
        acq = self._acq.ready()
        check_name(name)
        check_token(token)
        return bool(await acq.call("validate", self.driver.validate(name, token)))

    def stats(self) -> BackendStats:
        """A snapshot of counters and hold-time percentiles since the backend opened."""
        self._acq.catch_up()
        return self._session.stats.snapshot(held=len(self._session.live()))

    def collect_advice(
        self,
        *,
        name_template: Callable[[str], str] | None = None,
        max_templates: int = DEFAULT_MAX_TEMPLATES,
    ) -> None:
        """Start measuring holds, renewal round trips and loop lag for :meth:`advise`
        (opt-in: off, the hold path is the plain one; on, it costs about as much as a
        dict insert and pop per hold). Per lock-name template, fixed memory: at most
        ``max_templates`` templates (each about 1.3 KB), then one ``"(other)"``.

        ``name_template(name)`` groups names (default ``"invoice:42"`` -> ``"invoice:*"``);
        a lock from :meth:`locked_function` counts under its own template. Calling it
        again starts over. Warns (logger ``asynclock.advice``, once per template) when a
        hold comes within 80 % of its max_hold or a renewal near the ttl's safety margin.
        """
        if name_template is not None and not callable(name_template):
            raise TypeError(
                "name_template must be a function from a lock name to a low-cardinality "
                f"template (str -> str), not {type(name_template).__name__}"
            )
        if type(max_templates) is not int or not 1 <= max_templates <= 1_000_000:
            raise ValueError(
                f"max_templates must be an int from 1 to 1000000, got {max_templates!r}"
            )
        self.stop_advice()
        self._advice = AdviceCollector(
            self.drift,
            self.margin,
            self.heartbeat,
            name_template or default_name_template,
            max_templates,
        )
        self.add_observer(self._advice)

    def stop_advice(self) -> None:
        """Stop measuring for :meth:`advise` and forget what was measured."""
        if self._advice is not None:
            self.remove_observer(self._advice)
            self._advice = None

    def add_observer(self, observer: Observer) -> None:
        """Tell ``observer`` (an :class:`~asynclock.Observer`) of every acquisition, release,
        loss and renewal round of this backend from now on, after the observers added
        before it (``asynclock.otel.instrument`` and :meth:`collect_advice` add theirs).
        With no observer, a hold pays one attribute test for the seam."""
        if not isinstance(observer, Observer):
            raise TypeError(
                f"add_observer() takes an asynclock.Observer, not {type(observer).__name__}"
            )
        self._set_observers((*self.observers(), observer))

    def remove_observer(self, observer: Observer) -> None:
        """Stop telling ``observer`` (the others go on); nothing if it was not added."""
        self._set_observers(tuple(o for o in self.observers() if o is not observer))

    def observers(self) -> tuple[Observer, ...]:
        """The observers of this backend, in the order they are told."""
        current = self._session.observer
        if current is None:
            return ()
        if isinstance(current, Fanout):
            return current.observers
        return (current,)

    def _set_observers(self, observers: tuple[Observer, ...]) -> None:
        if not observers:
            self._session.observer = None
        elif len(observers) == 1:
            self._session.observer = observers[0]
        else:
            self._session.observer = Fanout(observers)

    def _ready(self) -> None:
        """Raise unless open and called on the backend's event loop (for tools)."""
        self._acq.ready()

    def _start_background(self, func: Callable[[], Coroutine[Any, Any, None]], name: str) -> None:
        """Run ``func`` in the backend's own task group until it returns or the backend
        closes (``serve_stats``). It must not raise: an error would close the backend."""
        self._acq.ready()
        assert self._tg is not None
        self._tg.start_soon(func, name=name)

    @property
    def advice_collected(self) -> bool:
        """True between :meth:`collect_advice` and :meth:`stop_advice`."""
        return self._advice is not None

    def advise(self, name: str) -> Advice:
        """ttl and ``max_hold`` for the locks of ``name``'s template (``name`` may be the
        template itself, e.g. ``"invoice:*"``), from what was measured since
        :meth:`collect_advice`. With too few samples (100 holds of the template, 20
        renewal rounds) the number is None and ``reasoning`` says what is missing; it
        never raises for that. RuntimeError if advice is not being collected."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a lock name or template (a non-empty str), got {name!r}")
        return self._collector().advise(name)

    def advice(self) -> list[Advice]:
        """:meth:`advise` for every template measured, sorted by template."""
        return self._collector().advice_all()

    def _collector(self) -> AdviceCollector:
        if self._advice is None:
            raise RuntimeError(
                "advice is not being collected on this backend: call "
                "backend.collect_advice() first, then hold locks for a while"
            )
        return self._advice

    async def _next_renewal_round(self) -> None:
        """Wait for the renewer's next round (``asynclock.testing.next_renewal_round``)."""
        await self._session.next_round()

    def held(self) -> list[Lease]:
        """The leases this backend currently holds (and renews)."""
        self._acq.catch_up()
        return self._session.live()

    async def holder(self, name: str) -> Holder | None:
        """Who holds ``name`` now, as the server sees it (a :class:`~asynclock.Holder`), or
        ``None``: a snapshot for operators, not for deciding who may write."""
        acq = self._acq.ready()
        check_name(name)
        if name.startswith("claim:"):  # a claimed row's lease (see claims()), if it is one
            try:
                held = await acq.call("holder", self.driver.claim_holder(name), (LookupError,))
                return cast("Holder | None", held)
            except LookupError:
                pass
        found = await acq.call("holder", self.driver.holder(name), (NotImplementedError,))
        return cast("Holder | None", found)

    async def holders(
        self, pattern: str = "*", *, limit: int = 1000, kinds: Collection[str] = ("lock",)
    ) -> list[Holder]:
        """Every name held now matching ``pattern`` (a shell-style glob: ``*``, ``?``,
        ``[seq]``; case-sensitive), as :meth:`holder` sees it, sorted by name: at most
        ``limit`` (1 .. 100000); not idempotency keys' locks (:meth:`idempotent`). ``kinds``:
        also (or only) permits and read-write holds, as ``sem.holders()``/``rw.holders()``
        see them (``"permit"``, ``"write"``, ``"read"``, ``"intent"``; a name's lock first).
        For operators (``asynclock list``): a question per name, not one instant's snapshot.
        NotImplementedError where the server cannot list them (the message says why)."""
        return await list_holders(self._acq.ready(), pattern, limit, kinds)

    async def locked(self, name: str) -> bool:
        """True if some lease holds ``name`` right now (a snapshot, as :meth:`holder`)."""
        return await self.holder(name) is not None

    async def break_lock(self, name: str) -> bool:
        """Remove whoever holds ``name`` (for operators); True if a live lease was removed.

        Logged at WARNING. The broken holder, in any process, loses its lease at its next
        renewal (:class:`LeaseLost`); the next token is larger. Not owner-checked: for a
        stuck holder. PostgreSQL ``mode=session`` ends the holder's session and its locks."""
        acq = self._acq.ready()
        check_name(name)
        logger.warning("break_lock(%r) on %s: removing whoever holds it", name, self.driver.display)
        call = self.driver.break_lock(name)
        broken = bool(await acq.call("break_lock", call, (NotImplementedError,)))
        if broken:
            logger.warning("break_lock(%r): a live lease was removed", name)
            # A holder on this very backend need not wait for its next renewal.
            self._session.lose_name(name, "lock broken by break_lock()")
        return broken

    def locked_function(
        self,
        name: str,
        /,
        *,
        ttl: float,
        timeout: float | None = None,
        blocking: bool = True,
        max_hold: float | None = None,
    ) -> Callable[[Callable[P, Awaitable[T]]], Callable[P, Coroutine[Any, Any, T]]]:
        """Decorate an ``async def`` function so every call runs holding a lock.

        ``name`` is a :class:`~asynclock.NameTemplate` of the call's arguments
        (``"invoice:{invoice_id}"``); the rest as in :meth:`lock`. A lost lease cancels the
        call, which raises :class:`LeaseLost`. At decoration, a function that is not
        ``async def`` or lacks a templated argument is a TypeError; a malformed template
        or bad lock arguments a ValueError.
        """
        return locked_function(self._templated_lock, name, (ttl, timeout, blocking, max_hold))

    def idempotent(
        self,
        key: str,
        *,
        ttl: float,
        fingerprint: object = None,
        keep: float = DEFAULT_KEEP,
        wait: float | None = None,
        store_errors: tuple[type[Exception], ...] = (),
    ) -> Idempotent:
        """Run an operation at most once per ``key`` and replay its result (docs/idempotency.md).

        ``async with backend.idempotent(key, ttl=...) as op:`` yields an
        :class:`~asynclock.IdempotentCall`. If the operation completed before, ``op.replayed``
        is True and ``op.result`` is its stored result: return it. Otherwise the body runs
        under a lease of ``ttl`` on the key (renewed by this backend, cancelled with
        :class:`LeaseLost` when lost) and stores its result with ``await op.save(result)``
        (fenced: :class:`StaleToken` if the lease is no longer live at the server). A body
        that ends without saving stores None. Or in one line:
        ``await backend.idempotent(key, ttl=...).run(fn, *args)``.

        Args:
            key: 1 to 255 UTF-8 bytes, no NUL, no lone surrogates.
            ttl: the lease's ttl, as for :meth:`lock`.
            fingerprint: any JSON-serialisable value naming the request (its arguments);
                its sha256 is stored, and a later call with the same key and another
                fingerprint raises :class:`IdempotencyKeyReused`. None: not checked.
            keep: seconds the record is kept after its last write (1 s to 30 days; 24 h).
            wait: None (default): a call while another one runs the operation raises
                :class:`InProgress` at once. Seconds: wait up to that long for its result
                (or for its lease to end, then run the operation here).
            store_errors: exception classes stored as the operation's outcome and replayed
                as :class:`ReplayedFailure`; any other error frees the key for a retry.
        """
        return Idempotent(self._acq, key, ttl, fingerprint, keep, wait, store_errors)

    def idempotent_function(
        self,
        key: str,
        /,
        *,
        ttl: float,
        fingerprint: tuple[str, ...] = (),
        keep: float = DEFAULT_KEEP,
        wait: float | None = None,
        store_errors: tuple[type[Exception], ...] = (),
    ) -> Callable[[Callable[P, Awaitable[T]]], Callable[P, Coroutine[Any, Any, T]]]:
        """Decorate an ``async def`` function so it runs at most once per key and every
        later call with that key returns the stored result (see :meth:`idempotent`).

        ``key`` is a :class:`~asynclock.NameTemplate` of the call's arguments
        (``"payment:{order_id}"``); ``fingerprint`` names the arguments whose values must
        match for a replay (``("amount", "currency")``). Checked at decoration: a function
        that is not ``async def``, or a template or fingerprint naming an argument it does
        not take, is a TypeError; bad options a TypeError or ValueError.
        """
        options = {"ttl": ttl, "keep": keep, "wait": wait, "store_errors": store_errors}
        return idempotent_function(self.idempotent, key, fingerprint, options)

    def leadership(self, name: str, *, ttl: float, identity: str | None = None) -> Leadership:
        """Campaign for leadership of ``name``; ``identity`` (default ``host:pid``) is what
        :meth:`leader` tells other processes.

        ``async with backend.leadership(name, ttl=...) as term:`` waits until elected; the
        body is cancelled when the term is lost and the block raises :class:`LeaseLost`.
        ``async for term in ...:`` with ``async with term:`` inside campaigns again after
        each loss (with backoff) until the loop is left; ``term.lease.lost.reason`` then
        says whether (and why) that term was lost. ``ttl`` is checked here, as by
        :meth:`lock`; campaigning inside this task's own hold of ``name`` is AlreadyHeld.
        """
        return Leadership(self._acq, name, ttl, identity)

    def claims(
        self,
        table: str,
        *,
        ttl: float,
        where: str | None = None,
        order_by: str | None = None,
        id_column: str = "id",
        schema: str | None = None,
        max_attempts: int = 5,
        identity: str | None = None,
    ) -> Claims:
        """Claim rows of your own ``table`` as work items (PostgreSQL only): ``async with
        backend.claims("jobs", ttl=30).take(limit=10) as batch:``; each row's completion is
        fenced by its claim token. ``where``/``order_by`` are trusted SQL over the table's
        columns. See docs/claims.md (columns, semantics, errors)."""
        from .claims import ClaimOptions, Claims

        options = ClaimOptions.checked(ttl, max_attempts, identity)
        if options.ttl <= self._session.min_ttl:
            raise self._session.ttl_error(options.ttl)
        store = self.driver.claim_store(
            table, where=where, order_by=order_by, id_column=id_column, schema=schema
        )
        return Claims(Holds(self._acq, store, "claim"), store, options)

    async def leader(self, name: str) -> Leader | None:
        """Who leads ``name`` now (its identity and token), or None if nobody holds it;
        NotImplementedError where the server keeps no owner (redlock, postgres session)."""
        self._acq.require_open()
        return await find_leader(self.driver, check_name(name))


def thread_grants(backend: Backend) -> Acquisition:
    """The door ``asynclock.from_thread`` takes to grant and release on a body's thread."""
    return backend._acq
