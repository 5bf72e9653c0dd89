"""``fleet_max_instances=True``: a job's ``max_instances`` counted across the fleet.

Each run of a claimed occurrence also holds one of ``job.max_instances`` permits of the
semaphore named after the job id (``backend.semaphore(job.id, job.max_instances)``),
taken right after the claim on the executor's event-loop thread and held, renewed with
the claims, by a task there until the run ends. A run that finds every permit held is
skipped the way APScheduler skips one at ``max_instances`` in one process (the same
warning, ``EVENT_JOB_MAX_INSTANCES``); a killed node's permit is free within its ttl
(apscheduler#1110: not "maximum number of running instances reached" for ever).
"""

from __future__ import annotations

import asyncio
import logging

import asynclock

logger = logging.getLogger("asynclock.apscheduler")


def instances_name(job_id: str) -> str:
    """The semaphore a job's runs share: the job id (semaphores have a namespace of their
    own, apart from the occurrences' locks)."""
    return job_id


class InstancePermit:
    """One permit of a job's semaphore, held by a task on the executor's loop until
    :meth:`end` (callable from any thread)."""

    __slots__ = ("_end", "_loop", "_task", "permit")

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._end = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.permit: asynclock.Permit | None = None

    @classmethod
    async def take(
        cls,
        backend: asynclock.Backend,
        job_id: str,
        limit: int,
        *,
        ttl: float,
        timeout: float | None,
    ) -> InstancePermit:
        """A permit (``timeout`` None: at once or ``LockHeld``; else wait that long, then
        ``AcquireTimeout``); raises what the semaphore's acquire raises."""
        self = cls()
        granted: asyncio.Future[asynclock.Permit] = self._loop.create_future()
        sem = backend.semaphore(instances_name(job_id), limit)
        blocking = timeout is not None

        async def keep() -> None:
            try:
                async with sem.acquire(ttl=ttl, timeout=timeout, blocking=blocking) as permit:
                    granted.set_result(permit)
                    await self._end.wait()
            except asynclock.LeaseLost as exc:
                logger.warning("job %r: its instance permit was lost: %s", job_id, exc)
            except BaseException as exc:
                if not granted.done():
                    granted.set_exception(exc)
                    return
                raise

        self._task = asyncio.ensure_future(keep())
        try:
            self.permit = await granted
        except BaseException:
            self._task.cancel()
            raise
        return self

    def end(self) -> None:
        """Give the permit back (from any thread); a no-op once done."""
        self._loop.call_soon_threadsafe(self._end.set)
