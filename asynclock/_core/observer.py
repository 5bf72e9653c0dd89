"""The telemetry seam: observers of one backend's acquisitions, releases, losses and
renewal rounds (``backend.add_observer``), and one process-wide hook for fence rejections.

The core imports no telemetry library: ``asynclock.otel`` implements :class:`Observer`
with OpenTelemetry, ``backend.collect_advice()`` with its measurements. The core calls an
observer explicitly where each event happens, each call behind one test of the session's
``observer`` attribute (None: nobody observes, and the hold path pays that one test).
Several observers are one :class:`Fanout`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .lease import Lease

#: Called with the fence's kind ("sql", "redis") each time a fence rejects a stale token
#: (set by ``asynclock.otel``; fences know no backend, so it is one per process).
on_stale_token: Callable[[str], None] | None = None


def stale_token(kind: str) -> None:
    """A fence of ``kind`` is about to raise StaleToken: tell the hook, if any."""
    hook = on_stale_token
    if hook is not None:
        hook(kind)


class Observer:
    """What a backend tells its observers (every method a no-op here; override some) once
    added with ``backend.add_observer(observer)``.

    Methods run on the backend's event loop, inline: they must be quick and not raise
    (:meth:`lost` runs after the holder is cancelled; if it raises, that is logged and
    the loss goes on).
    Every kind of hold is told alike: a lock, a leadership term, a claimed row, a permit.
    """

    def acquire_started(self, name: str, template: str | None) -> object:
        """An acquisition of ``name`` begins (``template``: the name template of the lock,
        if it was made from one, e.g. by ``backend.locked_function``). What it returns is
        handed to :meth:`acquire_finished`."""
        return None

    def acquire_finished(
        self, state: object, lease: Lease | None, waited: float, error: BaseException | None
    ) -> None:
        """It ended after ``waited`` seconds: granted ``lease``, or raised ``error``."""

    def adopted(self, lease: Lease) -> None:
        """The backend took over ``lease``, granted outside ``acquire``: to another thread
        by the driver's blocking call (``asynclock.from_thread``), or by a feature's own
        server step (a claimed row, a semaphore permit). No acquire hooks ran for it."""

    def released(self, lease: Lease, held: float) -> None:
        """A release of ``lease`` begins, ``held`` seconds after its request was sent (the
        hold is over, whatever the server answers; a repeated release calls it again)."""

    def lost(self, lease: Lease, reason: str) -> None:
        """``lease`` was lost (once per lease): ``reason`` as on LeaseLost."""

    def renewal_round(self, renewed: int, failed: int) -> None:
        """A renewal round ended: ``renewed`` leases extended, ``failed`` refused or not
        answered (retried until their deadline)."""

    def renewal_timing(self, round_trip: float, lag: float, leases: list[Lease]) -> None:
        """The same call's timings: ``round_trip`` seconds from sending the renewal of
        ``leases`` to its answer (or error), ``lag`` seconds the renewer woke late for its
        round (the event loop's lag)."""

    def renewal_behind(self, leases: int, left: float) -> None:
        """``leases`` renewals were sent with less than half of their margin left, the
        closest ``left`` seconds before its deadline: the renewer is falling behind."""


class Fanout(Observer):
    """Several observers of one backend (OpenTelemetry and advice), told in order."""

    def __init__(self, observers: tuple[Observer, ...]) -> None:
        self.observers = observers

    def acquire_started(self, name: str, template: str | None) -> object:
        return [o.acquire_started(name, template) for o in self.observers]

    def acquire_finished(
        self, state: object, lease: Lease | None, waited: float, error: BaseException | None
    ) -> None:
        assert isinstance(state, list)
        for o, s in zip(self.observers, state, strict=True):
            o.acquire_finished(s, lease, waited, error)

    def adopted(self, lease: Lease) -> None:
        for o in self.observers:
            o.adopted(lease)

    def released(self, lease: Lease, held: float) -> None:
        for o in self.observers:
            o.released(lease, held)

    def lost(self, lease: Lease, reason: str) -> None:
        for o in self.observers:
            o.lost(lease, reason)

    def renewal_round(self, renewed: int, failed: int) -> None:
        for o in self.observers:
            o.renewal_round(renewed, failed)

    def renewal_timing(self, round_trip: float, lag: float, leases: list[Lease]) -> None:
        for o in self.observers:
            o.renewal_timing(round_trip, lag, leases)

    def renewal_behind(self, leases: int, left: float) -> None:
        for o in self.observers:
            o.renewal_behind(leases, left)
