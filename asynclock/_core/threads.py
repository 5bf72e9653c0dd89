"""Leases held by threads other than the backend's loop thread (``asynclock.from_thread``):
a blocking grant on the calling thread, handed to the loop's session without waiting for
it, and a blocking release whose bookkeeping the loop does later (``session.inbox``)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import TYPE_CHECKING, Any, cast

from .bounds import CallBounds, cleanup
from .clock import Clock
from .driver import Driver
from .lease import Lease
from .renewer import IDLE_NAP
from .session import Session

if TYPE_CHECKING:
    from .lease import Grantor
    from .stats import StatsRecorder

logger = logging.getLogger("asynclock")
_get_ident = threading.get_ident

#: How another thread runs a function on the loop (``loop.call_soon_threadsafe``).
Post = Callable[..., object]


class ThreadGrants:
    """The other-thread half of :class:`~.acquisition.Acquisition` (a mixin: its state is
    the acquisition's)."""

    driver: Driver
    session: Session
    clock: Clock
    bounds: CallBounds
    stats: StatsRecorder
    open: bool
    _thread: int | None
    _owner_seq: Iterator[int]
    label_tag: str
    _spawned: set[Any]

    async def release(self, lease: Lease, quiet: bool = False) -> bool:
        raise NotImplementedError

    def thread_acquire(
        self, name: str, ttl: float, post: Post, on_lost: Callable[[], object]
    ) -> Lease | None:
        """On a thread other than the loop's: one attempt at ``name`` with the driver's
        blocking calls, the lease if granted now; None if the driver has no such calls, or
        the name is busy (or in a restart grace), or the attempt failed: the caller then
        acquires through the loop, which waits, queues and explains. ``on_lost`` runs on
        the loop when the lease is lost. ``post`` (the loop's ``call_soon_threadsafe``)
        hands the lease to the loop's renewer and watchdog, without waiting for them: its
        deadline counts from before the request was sent, wherever it is kept (G3)."""
        calls = self.driver.thread_calls()
        if calls is None or not self.open or ttl <= self.session.min_ttl:
            return None
        owner = "%032x" % next(self._owner_seq) + self.label_tag  # noqa: UP031 (as acquire)
        t_send = self.clock.now()
        try:
            token = calls.acquire(name, owner, ttl)
        except Exception as exc:
            # It may have been granted all the same: give it back (owner-checked) from the
            # loop; the loop's acquire that follows reports what is wrong.
            logger.debug("blocking acquire of %r failed, asking the loop: %r", name, exc)
            post(self._give_back, name, owner)
            return None
        if token is None:
            return None
        session = self.session
        grantor = cast("Grantor", self)  # (an Acquisition: this is its mixin)
        lease = session.new_lease(name, owner, token, ttl, t_send, None, grantor, self.driver)
        lease.lost._on_set = on_lost
        # Left for the loop, not posted: a wake-up of the loop thread per run costs as much
        # CPU as the round trip. The renewer looks within IDLE_NAP; only a lease that must
        # be renewed sooner than that (a short ttl) wakes it now.
        session.inbox_used = True
        session.inbox.append((self._adopt, (lease,)))
        if ttl * session.heartbeat < 2 * IDLE_NAP:
            post(session.run_inbox)
        return lease

    def catch_up(self) -> None:
        """On the loop: do now what other threads left for it (grants, releases), so a
        snapshot (``stats()``, ``held()``) includes them. Elsewhere: nothing."""
        if self.session.inbox and _get_ident() == self._thread:
            self.session.run_inbox()

    def thread_release(self, lease: Lease) -> bool:
        """On the thread :meth:`thread_acquire` granted ``lease`` to: release it at the
        server (owner-checked, G6) with the driver's blocking call, then hand the
        bookkeeping to the loop (its inbox) without waiting for it. True if released."""
        if lease._released:
            return False  # released by the loop already (the backend closed)
        # From here the renewer and the watchdog skip it (no renewal of a lease being
        # released, no loss reported for it), until _settle drops it on the loop.
        self.session.released_locally(lease)
        ok: bool | None = None
        calls = self.driver.thread_calls()
        try:
            if calls is not None and self.open:
                ok = calls.release(lease.name, lease.owner, lease.token)
        except Exception as exc:
            logger.warning(
                "release of %r token=%d was not confirmed (the server expires it within "
                "its ttl, %gs): %r",
                lease.name,
                lease.token,
                lease.ttl,
                exc,
            )
        finally:  # even if interrupted (a time limit's signal): the loop must drop it
            # Left for the loop (not urgent: the renewer and watchdog skip it already).
            self.session.inbox.append((self._settle, (lease, ok, self.clock.now())))
        return bool(ok)

    def _adopt(self, lease: Lease) -> None:
        """On the loop: renew a lease another thread was granted (:meth:`thread_acquire`)."""
        # (Queued before the release's _settle, so it runs first even for a short body.)
        if lease.lost:
            return  # lost before the loop saw it (force_loss, a close): never renewed
        self.session.adopt(lease)
        self.driver.adopted(lease.name, lease.owner)
        if not self.open and not lease._released:
            # Granted while the backend closed: nobody will renew it.
            self.session.lose(lease, "backend closed")
            self._spawn(self.release(lease, quiet=True))

    def _settle(self, lease: Lease, ok: bool | None, now: float) -> None:
        """On the loop: the bookkeeping of a release made by :meth:`thread_release`."""
        self.session.drop(lease)
        self.driver.forget(lease.owner)
        if self.session.observer is not None:
            self.session.observer.released(lease, now - lease.acquired_at)
        if ok is None:
            return  # not confirmed (logged), or the backend had closed and released it
        if ok and not lease.lost:
            self.session.finish(lease, now)
            return
        self.stats.hold_times.append(now - lease.acquired_at)
        if not ok and not lease.lost:
            lease.lost._set("lease had already ended at the server when released")
        logger.info(
            "release of %r token=%d was a no-op: lease already lost", lease.name, lease.token
        )

    def _give_back(self, name: str, owner: str) -> None:
        """On the loop: release what a failed blocking acquire may have been granted."""
        self._spawn(cleanup(self.driver.release(name, owner, None), self.bounds, "give back"))

    def _spawn(self, coro: Coroutine[Any, Any, object]) -> None:
        import asyncio

        task = asyncio.get_running_loop().create_task(coro)
        self._spawned.add(task)
        task.add_done_callback(self._spawned.discard)
