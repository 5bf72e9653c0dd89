"""An occurrence, its names, and the checks of a job's timing that make one run once."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from apscheduler.triggers.interval import IntervalTrigger

import asynclock


@dataclass(frozen=True, slots=True)
class Occurrence:
    """The occurrence a job runs for: its job id, scheduled run time and claim (and, with
    ``fleet_max_instances=True``, the run's instance permit: ``permit.slot``,
    ``permit.token``)."""

    job_id: str
    run_time: datetime
    lease: asynclock.Lease
    permit: asynclock.Permit | None = None

    @property
    def token(self) -> int:
        """The claim's fencing token: rises with the run time, for one job id."""
        return self.lease.token


_OCCURRENCE: ContextVar[Occurrence | None] = ContextVar("asynclock_occurrence", default=None)


def current_occurrence() -> Occurrence:
    """The occurrence the running job was claimed for (inside a ``ClaimingExecutor`` job).

    Raises:
        LookupError: not inside a job run by a ``ClaimingExecutor``.
    """
    occurrence = _OCCURRENCE.get()
    if occurrence is None:
        raise LookupError(
            "no claimed occurrence here: current_occurrence() works inside a job run by "
            "asynclock_apscheduler.ClaimingExecutor"
        )
    return occurrence


def occurrence_name(job_id: str, run_time: datetime) -> str:
    """The lock name of one occurrence: ``"{job id}@{run time in UTC, ISO 8601}"``."""
    return f"{job_id}@{run_time.astimezone(UTC).isoformat()}"


def done_name(job_id: str, run_time: datetime) -> str:
    """The done marker of one occurrence: a lease that says it finished somewhere."""
    return f"{occurrence_name(job_id, run_time)}#done"


def _grace(job: Any) -> float | None:
    # A job added before the scheduler starts gets the scheduler's job defaults only
    # when the scheduler adds it for real (APScheduler's own default is 1 second).
    default = getattr(getattr(job, "_scheduler", None), "_job_defaults", {}).get(
        "misfire_grace_time", 1
    )
    grace = getattr(job, "misfire_grace_time", default)
    return None if grace is None else float(grace)


def takeover_bounds(
    job: Any, *, claim_ttl: float, clock_skew: float, takeover_window: float | None
) -> tuple[float, float]:
    """(takeover window, done-marker ttl) in seconds for ``job``, default window applied.

    A claimant may start up to ``misfire_grace_time`` late and its clock may be off by
    ``clock_skew``; if it dies at once, its claim lasts ``claim_ttl`` more. A waiter must
    still be waiting then, so the window must exceed the sum of the three (the default
    adds one more ``claim_ttl`` of slack, which also covers a loss in the run's first
    ``claim_ttl``). The done marker must outlive the last attempt of any node: the window
    plus the skew, plus one ``claim_ttl`` of margin.
    """
    grace = _grace(job) or 0.0
    window = grace + clock_skew + 2 * claim_ttl if takeover_window is None else takeover_window
    return window, window + clock_skew + claim_ttl


def start_by(job: Any, run_time: datetime, clock_skew: float) -> datetime:
    """The latest an occurrence held up by a restart grace may start: within its misfire
    grace time (an occurrence claimed before the lock server lost its data never gets
    that far, see ``_claiming``), and ``clock_skew`` before the job's next run time, so
    the two are not claimed together and one job's tokens keep rising with run times."""
    latest = run_time + timedelta(seconds=_grace(job) or 0.0)
    following = job.trigger.get_next_fire_time(run_time, run_time + timedelta(microseconds=1))
    if following is not None:
        latest = min(latest, following - timedelta(seconds=clock_skew))
    return latest


def _triggers(trigger: Any) -> list[Any]:
    found = [trigger]
    for child in getattr(trigger, "triggers", None) or ():
        found.extend(_triggers(child))
    return found


def check_job(
    job: Any,
    *,
    claim_ttl: float,
    clock_skew: float = 1.0,
    takeover_window: float | None = None,
) -> None:
    """Refuse a job whose occurrences schedulers would not agree on, or could run twice.

    Raises ValueError naming the job and what to change: an interval trigger without a
    pinned ``start_date`` (every process counts from its own start), ``jitter`` (every
    process draws its own delay), ``misfire_grace_time=None`` (a late scheduler may run
    an occurrence any time later), or a claim ttl that does not cover the misfire grace
    time plus the clock skew between schedulers (a late scheduler would find the claim
    gone and run the occurrence again), or a takeover window that does not exceed the
    misfire grace time plus the clock skew plus the claim ttl (a waiter would give up
    before a dead claimant's claim expires, and nobody would take the occurrence over).
    """
    what = f"job {getattr(job, 'id', job)!r}"
    for trigger in _triggers(job.trigger):
        if getattr(trigger, "jitter", None):
            raise ValueError(
                f"{what}: its trigger has jitter={trigger.jitter!r}; each scheduler draws "
                "its own delay, so their run times differ and every one of them runs the "
                "job. Remove jitter when claiming occurrences"
            )
        if isinstance(trigger, IntervalTrigger) and trigger.start_date.microsecond != 0:
            raise ValueError(
                f"{what}: interval trigger without a fixed start_date (it counts from "
                f"{trigger.start_date.isoformat()}, this process's start), so each "
                "scheduler has its own run times and every one runs the job. Pass "
                "start_date= a fixed datetime in whole seconds, the same on every node"
            )
    grace = _grace(job)
    if grace is None:
        raise ValueError(
            f"{what}: misfire_grace_time=None lets a late scheduler run an occurrence any "
            "time after its claim has expired; give it a bound in seconds (claim_ttl "
            "must exceed it plus the clock skew)"
        )
    if claim_ttl <= grace + clock_skew:
        raise ValueError(
            f"{what}: claim_ttl={claim_ttl:g}s must exceed misfire_grace_time "
            f"({grace:g}s) + clock_skew ({clock_skew:g}s) = {grace + clock_skew:g}s: a "
            "scheduler that is late by up to that much must still find the claim (the "
            "claim is renewed while the job runs, so the run time itself is covered)"
        )
    window, done_ttl = takeover_bounds(
        job, claim_ttl=claim_ttl, clock_skew=clock_skew, takeover_window=takeover_window
    )
    least = grace + clock_skew + claim_ttl
    if window <= least:
        raise ValueError(
            f"{what}: takeover_window={window:g}s must exceed misfire_grace_time "
            f"({grace:g}s) + clock_skew ({clock_skew:g}s) + claim_ttl ({claim_ttl:g}s) = "
            f"{least:g}s: a claimant that starts late and dies at once holds its claim "
            "that long, and the other schedulers must still be waiting to take over"
        )
    if done_ttl > asynclock.MAX_TTL:
        raise ValueError(
            f"{what}: takeover_window={window:g}s is too long: the done marker must last "
            f"it + clock_skew + claim_ttl = {done_ttl:g}s, more than asynclock.MAX_TTL "
            f"({asynclock.MAX_TTL:g}s)"
        )
