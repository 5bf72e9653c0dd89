"""asynclock for APScheduler 3.11: each job occurrence runs once across a fleet of schedulers.

``ClaimingExecutor`` claims every occurrence (a lease on ``"{job.id}@{run time, UTC ISO}"``
whose token comes from the job's token scope) before it runs, holds the claim while the
job runs, stops the job when the claim is lost, and keeps the claim for its ttl after the
run so a late scheduler cannot run it again. ``leader_only`` runs a scheduler's jobs only
while it leads. Install with ``pip install "asynclock[apscheduler]"``.
"""

from ._executor import ClaimingExecutor, Occurrence, check_job, current_occurrence
from ._leader import LeaderOnly, leader_only

__all__ = (
    "ClaimingExecutor",
    "LeaderOnly",
    "Occurrence",
    "check_job",
    "current_occurrence",
    "leader_only",
)
