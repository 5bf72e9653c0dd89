"""``redis+sentinel://[user:password@]s1:26379,s2:26379,s3:26379/<service_name>[/<db>]`` —
a primary with replicas behind Redis Sentinel (URL forms: :mod:`.deployments`).

The backend asks the sentinels where the primary is, and follows a failover by watching
them, not only when the old primary fails: ``+switch-master`` on every sentinel it can
reach, and ``SENTINEL get-master-addr-by-name`` on each renewal round, a connection to the
primary that drops, and a ``READONLY`` answer all make it ask the sentinels again. (Measured
on Redis 7.0: after ``SENTINEL FAILOVER`` the sentinels announce the new primary about a
second later, and the old one stays a writable master for about ten more; a client that
waits for ``READONLY`` keeps renewing, and granting, on the old primary all that while.)

A failover is a restart: when the backend sees a primary with another ``run_id`` it loses
every lease the old primary granted at once (the holders are cancelled, ``LeaseLost``), and
only then grants on the new one. Before its first grant there, ADOPT marks the data as come
through a failover when the new primary was promoted from the old one's history
(``master_replid2``): the new primary grants nothing for the restart grace, and every token
it hands out from then on is above the old primary's. ``wait_replicas=N`` makes a grant,
renewal or idempotency record count only once ``N`` replicas have it (:mod:`.replication`).
"""

from __future__ import annotations

import logging
from typing import Any

import anyio

from ..._core.exceptions import BackendUnavailable
from .._common.urls import parse_multi_host_url
from .deployments import Deployment, read_deployment_url
from .keys import era_key
from .routed import NotPrimary, PrimaryDriver, Routed, cause
from .sentinels import Sentinels

logger = logging.getLogger("asynclock.redis")


class SentinelDriver(Routed):
    """Locks on the primary a set of sentinels names (see the module docstring)."""

    def __init__(self, dep: Deployment) -> None:
        options = {
            k: v
            for k, v in dep.options.items()
            if k not in ("sentinel_username", "sentinel_password")
        }
        super().__init__(dep.display, options)
        self.dep = dep
        self.sentinels = Sentinels(dep, self._announced, self._check_soon)
        self._current: PrimaryDriver | None = None
        #: Set when the primary must be checked with the sentinels.
        self._check = anyio.Event()
        #: Set once the check a grant waits for is done (None: nothing to wait for).
        self._gate: anyio.Event | None = None
        self._poll_due = anyio.Event()
        #: How long a grant waits for a check in progress, seconds.
        self.gate_timeout = 2 * dep.options["socket_timeout"] + dep.options["connect_timeout"]
        self._era = era_key(self.prefix).encode()

    @property
    def current(self) -> PrimaryDriver:
        if self._current is None:
            raise BackendUnavailable(f"{self.display}: not open")
        return self._current

    # -- lifecycle -------------------------------------------------------------------------

    async def open(self) -> None:
        try:
            address = await self.sentinels.resolve()
            self._current = await self._connect(address)
        except BaseException:
            await self.sentinels.aclose()
            raise
        self.start(self._current)
        self._open = True

    async def _connect(self, address: str) -> PrimaryDriver:
        host = parse_multi_host_url(f"redis://{address}").hosts[0]
        assert host.port is not None
        p = self.make_primary(self.dep.node(host.host, host.port), address)
        try:
            await p.open()
            await p.identify()
            if p.role != "master":
                raise BackendUnavailable(
                    f"{p.display}: the sentinels name it the primary of {self.dep.service!r}, "
                    f"but it is a {p.role or 'server of unknown role'} (a failover in progress?)"
                )
            await p.adopt(0, p.keys.epoch, self._era)
        except BaseException:
            await p.aclose()
            raise
        orig = p.listener.on_reset

        def on_reset() -> None:  # the primary's connection dropped: is it still the primary?
            orig()
            self._check_soon()

        p.listener.on_reset = on_reset
        return p

    async def aclose(self) -> None:
        await super().aclose()
        await self.sentinels.aclose()

    def primaries(self) -> list[PrimaryDriver]:
        return [] if self._current is None else [self._current]

    # -- following the primary -------------------------------------------------------------

    def _announced(self, address: str) -> None:
        """``+switch-master`` from a sentinel."""
        if self._current is None or address != self._current.address:
            self._suspect(gate=True)

    def _check_soon(self) -> None:
        self._suspect(gate=False)

    def _suspect(self, *, gate: bool) -> None:
        """Ask the sentinels again; ``gate``: grants wait for the answer (it may be a
        failover)."""
        if gate and self._gate is None:
            self._gate = anyio.Event()
        self._check.set()

    def _open_gate(self) -> None:
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.set()

    def renewed(self) -> None:
        self._poll_due.set()

    async def watcher(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.sentinels.run)
            tg.start_soon(self._poller)
            await self._follow()

    async def _poller(self) -> None:
        """On each renewal round: does any sentinel name another primary?"""
        while True:
            await self._poll_due.wait()
            self._poll_due = anyio.Event()
            try:
                moved = await self.sentinels.poll(self.current.address)
            except Exception as exc:
                logger.debug("%s: polling the sentinels failed: %r", self.display, exc)
                continue
            if moved:
                self._suspect(gate=True)

    async def _follow(self) -> None:
        backoff = 0.05
        while True:
            await self._check.wait()
            self._check = anyio.Event()
            try:
                address = await self.sentinels.resolve()
                if address != self.current.address:
                    await self._switch(address)
                backoff = 0.05
            except Exception as exc:
                logger.info("%s: following the primary failed, retrying: %s", self.display, exc)
                self._open_gate()  # grants go on where they went (a failover is announced)
                await anyio.sleep(backoff)
                backoff = min(2 * backoff, 1.0)
                self._check.set()
                continue
            self._open_gate()

    async def _switch(self, address: str) -> None:
        old = self.current
        new = await self._connect(address)
        if new.node.run_id is not None and new.node.run_id == old.node.run_id:
            # The same server under another address: its leases are still good.
            for owner, (name, token, p) in list(self._held.items()):
                if p is old:
                    self._held[owner] = (name, token, new)
                    new.adopted(name, owner)
            why = f"the primary {old.describe()} is now reached at {address}"
        else:
            why = (
                f"failover: the primary of {self.dep.service!r} moved from {old.describe()} "
                f"to {new.describe()}; every lease the old primary granted is lost (the new "
                "one may lack its last grants)"
            )
            logger.warning("%s: %s", self.display, why)
        # No await from here until the losses are signalled: nothing is granted on the new
        # primary before every holder of the old one is cancelled.
        self._current = new
        self.start(new)
        await self.retire(old, new, why)

    # -- routing ---------------------------------------------------------------------------

    async def route(self, name: str) -> PrimaryDriver:
        gate = self._gate
        if gate is not None:
            with anyio.move_on_after(self.gate_timeout):
                await gate.wait()
        return self.current

    def route_now(self, name: str) -> PrimaryDriver:
        return self.current

    async def before_grant(self, p: PrimaryDriver, name: str) -> None:
        await p.adopt(0, p.keys.epoch, self._era)  # again after a restart

    async def redirected(self, exc: BaseException, primary: PrimaryDriver) -> bool:
        if primary is not self._current:
            return True  # replaced meanwhile: ask the new one
        if "READONLY" in cause(exc) or isinstance(exc, NotPrimary):
            # Demoted: a failover the sentinels know about (or will): ask them, then retry.
            self._suspect(gate=True)
            gate = self._gate
            if gate is not None:
                with anyio.move_on_after(self.gate_timeout):
                    await gate.wait()
            return primary is not self._current
        self._check_soon()  # unreachable or failing: is it still the primary?
        return False


def driver_from_url(url: str, **options: Any) -> SentinelDriver:
    return SentinelDriver(read_deployment_url(url, options))


__all__ = ("SentinelDriver", "driver_from_url")
