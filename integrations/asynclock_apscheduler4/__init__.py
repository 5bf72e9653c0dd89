"""asynclock for APScheduler 4 (experimental): fencing tokens and stop-on-loss for its jobs.

APScheduler 4 coordinates schedulers natively (one data store; a scheduler acquires a job
under a lease it extends while the job runs), but it gives a job no fencing token, and a
job whose lease lapses (a frozen scheduler) is neither stopped nor kept from being
acquired again. ``ClaimingJobExecutor`` wraps one of its job executors: before a job runs
it takes a claim (an asynclock lease) on the job's occurrence, holds it while the job runs
(``asynclock.current_lease()`` answers inside), stops the job
when the claim is lost, and keeps the claim one more ttl after the run.

Pinned to the tested pre-release: ``pip install "asynclock[apscheduler4]"`` (it cannot be
installed together with the ``apscheduler`` extra, which is APScheduler 3).
"""

from ._executor import ClaimingJobExecutor, occurrence_name

__all__ = ("ClaimingJobExecutor", "occurrence_name")
