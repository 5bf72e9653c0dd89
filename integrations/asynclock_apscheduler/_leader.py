"""``leader_only``: a scheduler that runs jobs only while it leads (``backend.leadership``).

For schedules whose jobs must not even *start* on two nodes (a long migration): one
scheduler of the fleet leads and runs its jobs; the others stay paused and campaign. On
loss of the term the scheduler is paused at once and campaigns again.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import Any

import anyio
from apscheduler.events import EVENT_SCHEDULER_SHUTDOWN, EVENT_SCHEDULER_STARTED
from apscheduler.schedulers.base import STATE_STOPPED, BaseScheduler

import asynclock

from ._loop import Bridge, check_target

logger = logging.getLogger("asynclock.apscheduler")


class LeaderOnly:
    """The leadership campaign of one scheduler (see :func:`leader_only`).

    ``leading`` is set while this scheduler leads; ``term`` is the current term (its
    ``token`` fences the leader's writes) or None.
    """

    def __init__(
        self,
        scheduler: BaseScheduler,
        target: str | asynclock.Backend,
        name: str,
        ttl: float,
        identity: str | None,
    ) -> None:
        self.scheduler = scheduler
        self.name = name
        self.ttl = ttl
        self.identity = identity
        self.leading = threading.Event()
        self.term: asynclock.Term | None = None
        self.terms = 0
        self._loop_thread = Bridge(target)
        self._campaign: Future[Any] | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        state = "leading" if self.leading.is_set() else "following"
        return f"<LeaderOnly {self.name!r} {state}>"

    def _on_event(self, event: Any) -> None:
        if event.code == EVENT_SCHEDULER_STARTED:
            self.start()
        elif event.code == EVENT_SCHEDULER_SHUTDOWN:
            self.stop()

    def start(self) -> None:
        """Pause the scheduler and campaign (called when the scheduler starts)."""
        with self._lock:
            if self._campaign is not None:
                return
            self.scheduler.pause()
            self._loop_thread.open()
            thread, _ = self._loop_thread.require()
            self._campaign = thread.submit(self._run())

    def stop(self) -> None:
        """End the campaign (release the term) and close the backend."""
        with self._lock:
            campaign, self._campaign = self._campaign, None
            if campaign is None:
                return
            campaign.cancel()
            self._loop_thread.close()
            self.leading.clear()

    async def _run(self) -> None:
        delay = 0.1
        while True:
            try:
                await self._campaign_terms()
            except Exception as exc:
                # The lock server is unreachable: stay paused, say so, and try again.
                logger.error("%r: campaign failed, retrying in %.1fs: %r", self.name, delay, exc)
                await anyio.sleep(delay)
                delay = min(delay * 2, self.ttl)
            else:
                return

    async def _campaign_terms(self) -> None:
        _, backend = self._loop_thread.require()
        leadership = backend.leadership(self.name, ttl=self.ttl, identity=self.identity)
        async for term in leadership:
            async with term:
                self.term = term
                self.terms += 1
                try:
                    logger.info(
                        "%s leads %r (token %d): resuming", term.identity, self.name, term.token
                    )
                    self.leading.set()
                    if self.scheduler.state != STATE_STOPPED:
                        self.scheduler.resume()
                    await anyio.sleep_forever()
                finally:
                    self.leading.clear()
                    self.term = None
                    if self.scheduler.state != STATE_STOPPED:
                        self.scheduler.pause()
                    logger.warning("%r: leadership ended: scheduler paused", self.name)


def leader_only(
    scheduler: BaseScheduler,
    url_or_backend: str | asynclock.Backend,
    name: str,
    *,
    ttl: float,
    identity: str | None = None,
) -> LeaderOnly:
    """Run ``scheduler``'s jobs only while it leads ``name`` (call before or after start).

    The scheduler is paused when it starts (or now, if it runs) and resumed while it holds
    a term of ``backend.leadership(name, ttl=ttl, identity=identity)``; when the term is
    lost it is paused again at once and campaigns again. Jobs already running when the
    term is lost are not stopped: use :class:`ClaimingExecutor` too for that.
    """
    if not isinstance(scheduler, BaseScheduler):
        raise TypeError(
            f"scheduler must be an APScheduler 3 scheduler, not {type(scheduler).__name__}"
        )
    target = check_target(url_or_backend)
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str (a lock name), got {name!r}")
    ttl = asynclock.check_seconds(ttl, "ttl", lease=True)
    campaign = LeaderOnly(scheduler, target, name, float(ttl), identity)
    scheduler.add_listener(campaign._on_event, EVENT_SCHEDULER_STARTED | EVENT_SCHEDULER_SHUTDOWN)
    if scheduler.state != STATE_STOPPED:
        campaign.start()
    return campaign
