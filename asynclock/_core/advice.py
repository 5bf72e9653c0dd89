"""ttl and ``max_hold`` advice from what a backend measured (``backend.collect_advice()``).

An :class:`AdviceCollector` is an :class:`~.observer.Observer`: per lock-name *template*
it keeps one :class:`~.sketch.LogHistogram` of hold times (from the request to the
release), and per backend one of renewal round trips and one of event-loop lag (how late
the renewer woke for a round; one renewer renews every lease in one round trip, so both
are the backend's, not a template's). Memory is fixed: at most ``max_templates`` sketches
(default 1,000), then one ``"(other)"`` bucket for every template past the cap.

The rules (each stated in :attr:`Advice.reasoning` with the numbers used):

* ``max_hold = K_MAX_HOLD * p99(hold)``, K = 5: the seed's range is 3-10. With the minimum
  of 100 holds the p99 is the largest hold or next to it, so 3 would stop a holder barely
  past the worst seen; 10 keeps a hung holder's lock ten normal worst cases. 5 leaves room
  for the sketch's 4.3 % and the tail's sampling noise, and still frees a hung lock soon.
* ``ttl``: renewal makes the hold time irrelevant: the lease is extended every
  ``heartbeat * ttl``: so the ttl must only outlast one renewal that is slow. A renewal
  sent at ``heartbeat * ttl`` must be answered before the local deadline
  ``ttl * (1 - drift) - margin`` (G3), leaving ``ttl * (1 - drift - heartbeat) - margin``
  for it. Require that window to hold ``SAFETY`` (3) tail renewals, each ``p99(round
  trip) + p99(loop lag)`` (the first try and two retries):
  ``ttl = (SAFETY * (rtt99 + lag99) + margin) / (1 - drift - heartbeat)``, and at least
  ``MIN_TTL`` (1 s: below it renewals would run more than three times a second).
* Too few samples (fewer than ``MIN_HOLDS`` holds of the template, or ``MIN_ROUNDS``
  renewal rounds): the advice says so, with what is missing, and leaves that number None.

Warnings (logger ``asynclock.advice``, once per template and kind): a hold that ended
at 80 % or more of its lease's ``max_hold`` (or, without one, of the advised max_hold,
recomputed every 64 holds from the 128th: not a quantile per hold); a renewal round whose
round trip plus lag used more than a ``SAFETY``-th of the window above for a lease of the
template.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .observer import Observer
from .sketch import RELATIVE_ERROR, SKETCH_BYTES, LogHistogram

if TYPE_CHECKING:
    from .lease import Lease

logger = logging.getLogger("asynclock.advice")

K_MAX_HOLD = 5
SAFETY = 3
MIN_TTL = 1.0
MIN_HOLDS = 100
MIN_ROUNDS = 20
#: A hold at this fraction of max_hold is "close" (warned about).
CLOSE = 0.8
DEFAULT_MAX_TEMPLATES = 1000
#: Where holds of templates past ``max_templates`` are counted.
OTHER = "(other)"
#: Held leases tracked at most (a lease lost and collected unreleased is forgotten here).
_MAX_TRACKED = 100_000


def default_name_template(name: str) -> str:
    """``"invoice:42"`` -> ``"invoice:*"``; a name without ``:`` -> ``"*"``."""
    head, sep, _ = name.partition(":")
    return f"{head}:*" if sep else "*"


@dataclass(frozen=True, slots=True)
class Advice:
    """ttl and ``max_hold`` suggested for the locks of one name template, from measured
    holds and renewals (``backend.advise(name)``). A number is None when there were too
    few samples for it; :attr:`reasoning` says how many more are needed."""

    #: The lock-name template the numbers are about ("invoice:*", or "(other)").
    template: str
    #: Suggested ``max_hold`` (seconds): K * p99 hold; None with < MIN_HOLDS holds.
    max_hold: float | None
    #: Suggested ``ttl`` (seconds) from renewal round trips and loop lag; None with fewer
    #: than MIN_ROUNDS renewal rounds.
    ttl: float | None
    #: Holds of this template measured.
    samples: int
    #: Renewal rounds of the backend measured.
    renewal_samples: int
    hold_p99: float
    hold_max: float
    round_trip_p99: float
    loop_lag_p99: float
    #: How the numbers were reached, with the figures used (or what is missing).
    reasoning: str

    @property
    def enough(self) -> bool:
        """True when both numbers could be given."""
        return self.max_hold is not None and self.ttl is not None

    def as_dict(self) -> dict[str, object]:
        """A JSON-ready dict of every field."""
        return {
            "template": self.template,
            "max_hold": self.max_hold,
            "ttl": self.ttl,
            "samples": self.samples,
            "renewal_samples": self.renewal_samples,
            "hold_p99": self.hold_p99,
            "hold_max": self.hold_max,
            "round_trip_p99": self.round_trip_p99,
            "loop_lag_p99": self.loop_lag_p99,
            "enough": self.enough,
            "reasoning": self.reasoning,
        }


def advised_ttl(round_trip_p99: float, lag_p99: float, drift: float, margin: float,
                heartbeat: float) -> float:  # fmt: skip
    """The ttl rule (module docstring), before rounding."""
    window = 1 - drift - heartbeat
    return max(MIN_TTL, (SAFETY * (round_trip_p99 + lag_p99) + margin) / window)


def _round_up(seconds: float) -> float:
    """Up to 2 significant digits, rounded up: a number to write in a config file."""
    if seconds <= 0:
        return seconds
    scale = 10.0 ** (math.floor(math.log10(seconds)) - 1)
    return round(math.ceil(seconds / scale - 1e-9) * scale, 12)


_HOLD, _RENEWAL = 1, 2  # _Template.warned bits
#: Holds between two recomputations of a template's advised max_hold (for its warning).
_REFRESH = 64


class _Template:
    __slots__ = ("holds", "limit", "warned")

    def __init__(self) -> None:
        self.holds = LogHistogram()
        #: The advised max_hold when last computed (inf until MIN_HOLDS holds).
        self.limit = math.inf
        self.warned = 0  # _HOLD | _RENEWAL: warned about once already


class AdviceCollector(Observer):
    """The observer behind ``backend.collect_advice()`` (see the module docstring)."""

    def __init__(
        self,
        drift: float,
        margin: float,
        heartbeat: float,
        name_template: Callable[[str], str] = default_name_template,
        max_templates: int = DEFAULT_MAX_TEMPLATES,
    ) -> None:
        self.drift, self.margin, self.heartbeat = drift, margin, heartbeat
        self.name_template = name_template
        self.max_templates = max_templates
        self.templates: dict[str, _Template] = {}
        self.round_trips = LogHistogram()
        self.lag = LogHistogram()
        #: owner -> (template name, its sketches), for the leases held now.
        self.held: dict[str, tuple[str, _Template]] = {}

    # -- the observer hooks ----------------------------------------------------------------

    def acquire_started(self, name: str, template: str | None) -> object:
        return template

    def acquire_finished(
        self, state: object, lease: Lease | None, waited: float, error: BaseException | None
    ) -> None:
        if lease is not None:
            self._track(lease, state if isinstance(state, str) else None)

    def adopted(self, lease: Lease) -> None:
        self._track(lease, None)

    def released(self, lease: Lease, held: float) -> None:
        entry = self.held.pop(lease.owner, None)
        if entry is None:
            return  # a repeated release, or granted before collection began
        template, sketches = entry
        holds = sketches.holds
        holds.add(held)
        if sketches.warned & _HOLD:
            return
        if lease.hard_deadline is not None:
            limit = lease.hard_deadline - lease.acquired_at
            what, then = "its max_hold", "a slower holder is stopped (LeaseLost)"
        else:
            if holds.count % _REFRESH == 0 and holds.count >= MIN_HOLDS:  # not every hold
                sketches.limit = K_MAX_HOLD * holds.quantile(0.99)
            limit = sketches.limit
            what = "the advised max_hold"
            then = "with max_hold set so, a hold like it would be stopped (LeaseLost)"
        if held >= CLOSE * limit:
            sketches.warned |= _HOLD
            logger.warning(
                "locks %r: a hold of %r lasted %.3gs, %d%% of %s %.3gs; %s. See "
                "backend.advise(%r).",
                template,
                lease.name,
                held,
                round(100 * held / limit),
                what,
                limit,
                then,
                lease.name,
            )

    def renewal_timing(self, round_trip: float, lag: float, leases: list[Lease]) -> None:
        self.round_trips.add(round_trip)
        self.lag.add(lag)
        used = round_trip + lag
        keep = 1 - self.drift - self.heartbeat
        for lease in leases:
            window = lease.ttl * keep - self.margin
            if used * SAFETY <= window:
                continue
            entry = self.held.get(lease.owner)
            if entry is None or entry[1].warned & _RENEWAL:
                continue
            template, sketches = entry
            sketches.warned |= _RENEWAL
            logger.warning(
                "locks %r: a renewal round took %.3gs (round trip %.3gs + loop lag %.3gs), "
                "more than a third of the %.3gs a lease with ttl=%gs has for it; a slower one "
                "loses the lease. Raise the ttl: see backend.advise(%r).",
                template,
                used,
                round_trip,
                lag,
                window,
                lease.ttl,
                lease.name,
            )

    # -- reading ---------------------------------------------------------------------------

    def template_of(self, name: str) -> str:
        """The template ``name`` counts under: itself if it is one measured, else
        ``name_template(name)``, or ``"(other)"`` past the cap."""
        if name in self.templates:
            return name
        template = self.name_template(name)
        if template in self.templates or len(self.templates) < self.max_templates:
            return template
        return OTHER

    def advise(self, name: str) -> Advice:
        template = self.template_of(name)
        found = self.templates.get(template)
        holds = found.holds if found is not None else LogHistogram()
        return self._advice(template, holds)

    def advice_all(self) -> list[Advice]:
        return [self._advice(t, s.holds) for t, s in sorted(self.templates.items())]

    def memory_bytes(self) -> int:
        """Bytes of sketch counts kept now (templates plus the two backend sketches)."""
        return SKETCH_BYTES * (len(self.templates) + 2)

    def _advice(self, template: str, holds: LogHistogram) -> Advice:
        rtt, lag = self.round_trips, self.lag
        hold_p99 = holds.quantile(0.99)
        rtt99, lag99 = rtt.quantile(0.99), lag.quantile(0.99)
        why: list[str] = []
        max_hold: float | None = None
        ttl: float | None = None
        if holds.count >= MIN_HOLDS:
            max_hold = _round_up(K_MAX_HOLD * hold_p99)
            why.append(
                f"max_hold {max_hold:g}s = {K_MAX_HOLD} x p99 hold {hold_p99:.3g}s "
                f"({holds.count} holds, longest {holds.max:.3g}s; quantiles within "
                f"{RELATIVE_ERROR:.1%})."
            )
        else:
            why.append(
                f"max_hold: not enough samples: {holds.count} of {MIN_HOLDS} holds of "
                f"{template!r} measured."
            )
        if rtt.count >= MIN_ROUNDS:
            raw = advised_ttl(rtt99, lag99, self.drift, self.margin, self.heartbeat)
            ttl = _round_up(raw)
            window = 1 - self.drift - self.heartbeat
            why.append(
                f"ttl {ttl:g}s: a renewal is sent {self.heartbeat:.3g} x ttl after the last "
                f"and must land before the deadline ttl x (1 - drift {self.drift:g}) - margin "
                f"{self.margin:g}s; that window must hold {SAFETY} slow renewals of p99 round "
                f"trip {rtt99:.3g}s + p99 loop lag {lag99:.3g}s ({rtt.count} rounds): "
                f"({SAFETY} x {rtt99 + lag99:.3g} + {self.margin:g}) / {window:.3g} = "
                f"{(SAFETY * (rtt99 + lag99) + self.margin) / window:.3g}s, at least "
                f"{MIN_TTL:g}s. Hold time does not matter: renewal extends the lease."
            )
        else:
            why.append(
                f"ttl: not enough samples: {rtt.count} of {MIN_ROUNDS} renewal rounds "
                "measured (renewals run while a lease is held past heartbeat x ttl)."
            )
        return Advice(
            template=template,
            max_hold=max_hold,
            ttl=ttl,
            samples=holds.count,
            renewal_samples=rtt.count,
            hold_p99=hold_p99,
            hold_max=holds.max,
            round_trip_p99=rtt99,
            loop_lag_p99=lag99,
            reasoning=" ".join(why),
        )

    def _track(self, lease: Lease, template: str | None) -> None:
        if template is None:
            template = self.name_template(lease.name)
        sketches = self.templates.get(template)
        if sketches is None:
            if len(self.templates) >= self.max_templates:
                template = OTHER
                sketches = self.templates.get(OTHER)
            if sketches is None:
                sketches = self.templates[template] = _Template()
        held = self.held
        if len(held) >= _MAX_TRACKED:
            del held[next(iter(held))]
        held[lease.owner] = (template, sketches)
