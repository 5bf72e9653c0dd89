"""asynclock for APScheduler 3.11: each job occurrence runs once across a fleet of schedulers.

``ClaimingExecutor`` claims every occurrence (a lease on ``"{job.id}@{run time, UTC ISO}"``
whose token comes from the job's token scope) before it runs, holds the claim while the
job runs, and stops the job when the claim is lost; a node that found the claim busy
waits for it and takes the occurrence over if its claimant froze or died, while a
finished run leaves a done marker so that nobody runs it again. ``leader_only`` runs a
scheduler's jobs only while it leads. Install with ``pip install "asynclock[apscheduler]"``.
"""

from ._executor import ClaimingExecutor
from ._jobs import Occurrence, check_job, current_occurrence
from ._leader import LeaderOnly, leader_only

__all__ = (
    "ClaimingExecutor",
    "LeaderOnly",
    "Occurrence",
    "check_job",
    "current_occurrence",
    "leader_only",
)
