"""The telemetry seam: an optional observer of one backend's acquisitions, releases,
losses and renewal rounds, and one process-wide hook for fence rejections.

The core imports no telemetry library: ``asynclock.otel`` implements :class:`Observer`
with OpenTelemetry. A backend has no observer by default, and then pays nothing on the
hold path: :func:`observe` puts wrappers of ``acquire`` and ``release`` on the backend's
:class:`~asynclock._core.acquisition.Acquisition` instance (shadowing its methods), so an
uninstrumented hold runs exactly the code it ran before the seam existed. The session's
loss and renewal hooks are one attribute check each, off the hold path.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .acquisition import Acquisition
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
    """What a backend tells its observer (every method a no-op here; override some).

    Methods run on the backend's event loop, inline: they must be quick and not raise.
    """

    def acquire_started(self, name: str, template: str | None) -> object:
        """An acquisition of ``name`` begins (``template``: the lock's name template, if
        it was made from one). What it returns is handed to :meth:`acquire_finished`."""
        return None

    def acquire_finished(
        self, state: object, lease: Lease | None, waited: float, error: BaseException | None
    ) -> None:
        """It ended after ``waited`` seconds: granted ``lease``, or raised ``error``."""

    def adopted(self, lease: Lease) -> None:
        """The loop took over ``lease``, granted to another thread by the driver's blocking
        call (``asynclock.from_thread``): no acquire hooks ran for it."""

    def released(self, lease: Lease, held: float) -> None:
        """A release of ``lease`` begins, ``held`` seconds after its request was sent (the
        hold is over, whatever the server answers; a repeated release calls it again)."""

    def lost(self, lease: Lease, reason: str) -> None:
        """``lease`` was lost (once per lease): ``reason`` as on LeaseLost."""

    def renewal_round(self, renewed: int, failed: int) -> None:
        """A renewal round ended: ``renewed`` leases extended, ``failed`` refused or not
        answered (retried until their deadline)."""

    def renewal_timing(self, round_trip: float, lag: float, leases: list[Lease]) -> None:
        """The same round's timings: ``round_trip`` seconds from sending the renewal of
        ``leases`` to its answer (or error), ``lag`` seconds the renewer woke late for it
        (the event loop's lag). Measured only when an observer is installed."""


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


def observers_of(acq: Acquisition) -> tuple[Observer, ...]:
    """The observers of ``acq``'s backend now."""
    current = acq.session.observer
    if current is None:
        return ()
    if isinstance(current, Fanout):
        return current.observers
    return (current,)


def add_observer(acq: Acquisition, observer: Observer) -> None:
    """Tell ``observer`` too, after the observers already installed."""
    observe_all(acq, (*observers_of(acq), observer))


def remove_observer(acq: Acquisition, observer: Observer) -> None:
    """Stop telling ``observer`` (the others go on)."""
    observe_all(acq, tuple(o for o in observers_of(acq) if o is not observer))


def observe_all(acq: Acquisition, observers: tuple[Observer, ...]) -> None:
    """Make ``observers`` the observers of ``acq``'s backend (none: the plain hold path)."""
    if not observers:
        observe(acq, None)
    elif len(observers) == 1:
        observe(acq, observers[0])
    else:
        observe(acq, Fanout(observers))


def observe(acq: Acquisition, observer: Observer | None) -> None:
    """Make ``observer`` the only observer of ``acq``'s backend (None: stop observing)."""
    session = acq.session
    for attr in ("acquire", "release"):
        acq.__dict__.pop(attr, None)  # back to the methods of the class
    session.observer = observer
    if observer is None:
        return
    acq.acquire = _observed_acquire(acq, observer)  # type: ignore[method-assign]
    acq.release = _observed_release(acq, observer)  # type: ignore[method-assign]


def _observed_acquire(
    acq: Acquisition, observer: Observer
) -> Callable[..., Coroutine[Any, Any, Lease]]:
    inner = acq.acquire  # the class's (observe() removed any wrapper first)
    now = acq.clock.now

    async def acquire(
        name: str, ttl: float, timeout: float | None, blocking: bool, *args: Any, **kw: Any
    ) -> Lease:
        # Lock.__aenter__ passes (lock, task, stack) last: a lock made from a template
        # (locked_function) carries it.
        holder = args[3] if len(args) > 3 else kw.get("holder")
        template = getattr(holder[0], "_template", None) if holder is not None else None
        state = observer.acquire_started(name, template)
        started = now()
        try:
            lease = await inner(name, ttl, timeout, blocking, *args, **kw)
        except BaseException as exc:
            observer.acquire_finished(state, None, now() - started, exc)
            raise
        observer.acquire_finished(state, lease, now() - started, None)
        return lease

    return acquire


def _observed_release(
    acq: Acquisition, observer: Observer
) -> Callable[..., Coroutine[Any, Any, bool]]:
    inner = acq.release
    now = acq.clock.now

    # Not a coroutine: the held time is taken as the release starts, and the caller awaits
    # the release itself (no coroutine layer more per hold).
    def release(lease: Lease, *args: Any, **kw: Any) -> Coroutine[Any, Any, bool]:
        observer.released(lease, now() - lease.acquired_at)
        return inner(lease, *args, **kw)

    return release
