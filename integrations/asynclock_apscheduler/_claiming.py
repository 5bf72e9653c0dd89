"""Getting an occurrence's claim, and recording it done, through busy answers, a lock-server
outage and a restart grace (the executor's round trips; ``_executor.py`` decides what to run).

Each answer that holds a claim attempt up is waited for differently:

- **busy**: another node has the claim (it runs the occurrence, has just finished it, or
  froze or died running it). Wait for the claim until the takeover window ends.
- **unreachable** (``BackendUnavailable``): the attempt is repeated, with backoff, until
  the takeover window ends; then the occurrence is reported missed, never dropped.
- **restart grace** (``RestartGrace``): the server lost its data a short while ago (a
  new database, a restart without persistence) and grants nothing until the grace ends. Done
  markers went with the data, so "nobody has the claim" no longer means "nobody ran it".
  An occurrence waits for the grace only if it can still start by ``start_by`` (its
  misfire grace time, and before the job's next run time); otherwise it is reported
  missed at once. Why that is safe: an occurrence someone claimed before the loss was
  claimed at most ``clock_skew`` before its run time, and the grace ends at least
  ``claim_ttl`` after the loss (Redis: ``restart_grace`` after the server's start, which
  must be ``>= claim_ttl``; by default the first ttl asked for after the start, a claim's
  or a done marker's where only schedulers use the database), so it ends more than
  ``claim_ttl - clock_skew > misfire_grace_time`` after the run time (:func:`check_job`):
  never by ``start_by``. A node whose first attempt comes after the
  grace is past the misfire grace time by then, and the executor reports it missed too.
  Ending by the next run time keeps one job's tokens rising with its run times.

A grace is slept through (to its end, then a non-blocking attempt races for the claim).
A blocking wait for a busy claim is cut into slices of half a claim ttl, each followed by
a non-blocking attempt: a blocking acquire waits through a restart grace silently, and a
grace lasts at least a claim ttl, so none can begin and end unseen within a slice.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import anyio

import asynclock

logger = logging.getLogger("asynclock.apscheduler")

_FIRST_RETRY = 0.05  # seconds before the first repeat of an attempt the server did not answer
_MOST_RETRY = 1.0  # ... and at most between two (and under a quarter of the claim ttl)


@dataclass(frozen=True, slots=True)
class Got:
    """The claim is ours and no done marker was there: run the occurrence."""

    lease: asynclock.Lease
    waited: bool  # got only after another node held it: a takeover


@dataclass(frozen=True, slots=True)
class Skipped:
    """Another node ran the occurrence, or still held its claim when the window ended."""

    why: str


@dataclass(frozen=True, slots=True)
class Missed:
    """The occurrence could not be claimed in time: report it missed (``why`` says so)."""

    why: str


class _Backoff:
    def __init__(self, ttl: float) -> None:
        self.delay = _FIRST_RETRY
        self.most = min(_MOST_RETRY, ttl / 4)

    async def sleep(self, left: float) -> bool:
        """Sleep the next delay (jittered, at most ``left``); False if no time is left."""
        if left <= 0:
            return False
        await anyio.sleep(min(left, self.delay * (0.5 + random.random() / 2)))
        self.delay = min(2 * self.delay, self.most)
        return True


def _left(until: datetime) -> float:
    return (until - datetime.now(UTC)).total_seconds()


def _clock(when: datetime) -> str:
    return when.astimezone(UTC).strftime("%H:%M:%S.%f")[:-3] + " UTC"


def _grace_missed(grace: asynclock.RestartGrace, start_by: datetime) -> Missed:
    ends = datetime.now(UTC) + timedelta(seconds=grace.retry_after or 0.0)
    return Missed(
        f"the lock server grants nothing before {_clock(ends)} (its restart grace: it lost "
        f"its data a short while ago, and the done markers with it), later than "
        f"{_clock(start_by)}, the latest this occurrence may start (its misfire_grace_time, "
        "and before the job's next run time); one due before the loss may have run "
        "already, so it is not run again"
    )


def _unreachable(exc: Exception) -> Missed:
    return Missed(f"the lock server was unreachable until the takeover window ended: {exc}")


async def get_claim(
    backend: asynclock.Backend,
    name: str,
    *,
    ttl: float,
    scope: str,
    done: str,
    start_by: datetime,
    window_end: datetime,
) -> Got | Skipped | Missed:
    """Claim occurrence ``name`` (see the module doc), then read its done marker ``done``."""
    backoff = _Backoff(ttl)
    waited = False
    grace: asynclock.RestartGrace | None = None  # the last answer's, unless busy since
    lease: asynclock.Lease | None = None
    while lease is None:
        try:
            lease = await backend.acquire(name, ttl=ttl, blocking=False, token_scope=scope)
            break
        except asynclock.RestartGrace as exc:
            grace, wait = exc, exc.retry_after or 0.0
            if wait > _left(start_by):
                return _grace_missed(exc, start_by)
            # To its end (a few ms at least: the server's clock decides), then race for it.
            await anyio.sleep(max(_FIRST_RETRY / 10, min(wait, ttl / 2)))
            continue
        except asynclock.LockHeld:
            waited, grace = True, None
        except asynclock.BackendUnavailable as exc:
            if not await backoff.sleep(_left(window_end)):
                return _unreachable(exc)
            continue
        left = _left(window_end)
        if left <= 0:
            return Skipped("it stayed claimed elsewhere until the takeover window ended")
        try:
            lease = await backend.acquire(
                name, ttl=ttl, timeout=min(left, ttl / 2), token_scope=scope
            )
        except asynclock.AcquireTimeout:
            pass
        except asynclock.BackendUnavailable as exc:
            if not await backoff.sleep(_left(window_end)):
                return _unreachable(exc)
    outcome = await _read_done(backend, lease, done, window_end)
    if outcome is None and grace is not None and _left(start_by) < 0:
        # Got at the end of a grace, too late to start: it may be one that ran before.
        outcome = _grace_missed(grace, start_by)
    if outcome is None:
        return Got(lease, waited)
    await _give_back(lease)
    return outcome


async def _read_done(
    backend: asynclock.Backend, lease: asynclock.Lease, done: str, window_end: datetime
) -> Skipped | Missed | None:
    """Skipped if the done marker is there, None if not; asked again (the claim held)
    while the server does not answer."""
    backoff = _Backoff(lease.ttl)
    while True:
        try:
            marker = await backend.holder(done)
        except asynclock.BackendUnavailable as exc:
            if lease.lost or not await backoff.sleep(min(_left(window_end), lease.remaining())):
                return Missed(f"its done marker could not be read: {exc}")
            continue
        if marker is None:
            return None
        if marker.grace_until is not None:  # the data, our fresh claim with it, just went
            return Missed("the lock server lost its data right after the claim was granted")
        return Skipped("it already ran elsewhere")


async def _give_back(lease: asynclock.Lease) -> None:
    try:
        await lease.release()
    except asynclock.BackendUnavailable as exc:  # it expires within its ttl anyway
        logger.warning("releasing the claim of occurrence %s failed: %r", lease.name, exc)


async def record_done(
    backend: asynclock.Backend, lease: asynclock.Lease, done: str, done_ttl: float
) -> None:
    """The run finished while its claim held: record the done marker, then release.

    The marker is written only while the claim is still ours (checked on the clock right
    before, as for any side effect); a waiter reads it right after it gets the claim, so
    it never re-runs a finished occurrence. While the server does not answer, the claim
    is kept (renewed) and the marker tried again; once the claim is lost, a waiter takes
    the occurrence over. A restart grace means the server lost its data since the claim
    was granted: the other nodes report the occurrence missed rather than run it again.
    """
    backoff = _Backoff(lease.ttl)
    while True:
        try:
            lease.check()
        except asynclock.LeaseLost:
            return
        try:
            marker = await backend.acquire(done, ttl=done_ttl, blocking=False)
        except asynclock.RestartGrace as exc:
            logger.error(
                "occurrence %s ran here, but the lock server lost its data before its done "
                "marker was written (%s); the other nodes report it missed, they do not run "
                "it again",
                lease.name,
                exc,
            )
        except asynclock.LockHeld:
            logger.error(
                "occurrence %s finished here, but its done marker was already there: it "
                "finished elsewhere too (its claim was lost right before the marker was "
                "written, and taken over)",
                lease.name,
            )
        except asynclock.BackendUnavailable as exc:
            if await backoff.sleep(lease.remaining()):
                continue
            logger.error("could not record occurrence %s as done: %r", lease.name, exc)
            return
        except Exception as exc:
            logger.error("could not record occurrence %s as done: %r", lease.name, exc)
            await lease.let_expire()  # keeps waiters out one more ttl
            return
        else:
            await marker.let_expire()  # nobody renews it: it lasts done_ttl from now
        await _give_back(lease)
        return


def monotonic_deadline(until: datetime) -> float:
    """``time.monotonic()`` at wall-clock time ``until``."""
    return time.monotonic() + max(0.0, _left(until))
