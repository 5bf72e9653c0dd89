"""The drill's report: what happened (:class:`DrillReport`, :class:`Fault`), the verdict
on it (:func:`judge`), and the report as ONE self-contained HTML page: an SVG timeline plus
the tables.

The page has no scripts, no external resources. The timeline has one lane per worker (``g.lane``,
``data-worker``), a bar per hold (``rect.lease``, red-edged when the hold ended in a lost
lease), a mark per write (``circle.write``: green accepted, red ``rejected``), and one
marker per fault (``g.fault``, ``data-fault``) spanning its time. Tests and browsers find
them by these classes.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

from .history import Hold, Write, overlaps


@dataclass(frozen=True)
class Fault:
    """One injected fault: what, on whom, from ``start`` to ``end`` (monotonic seconds)."""

    kind: str
    #: A worker's lane (``w1``...), or the lock server killed (``server``/``node HOST:PORT``).
    target: str
    start: float
    end: float
    detail: str = ""

    @property
    def lasted(self) -> float:
        """Seconds the fault lasted."""
        return max(0.0, self.end - self.start)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "fault",
            "fault": self.kind,
            "target": self.target,
            "start": self.start,
            "end": self.end,
            "detail": self.detail,
        }


@dataclass
class DrillReport:
    """What a drill did and whether anything was lost. ``ok``: the verdict."""

    backend: str
    url: str
    fence: bool
    workers: int
    duration: float
    ttl: float
    start: float = 0.0
    end: float = 0.0
    holds: list[Hold] = field(default_factory=list)
    #: When the attempt that got each hold was sent (same order as ``holds``; its grant
    #: came after this, and before the hold's ``start``).
    sent: list[float] = field(default_factory=list)
    writes: list[Write] = field(default_factory=list)
    #: The value each write carried (same order as ``writes``).
    values: list[int] = field(default_factory=list)
    #: Whether each write was a late one (sent after its lease was lost).
    late: list[bool] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    #: (killed, back) per lock server kill -9: when it died and when it served again.
    outages: list[tuple[float, float]] = field(default_factory=list)
    #: Faults asked for but not applicable here (e.g. partition on SQLite: no TCP).
    skipped: list[str] = field(default_factory=list)
    final: int = 0
    #: Writes the store itself logged as accepted (the truth when a worker died mid-write).
    applied: int = 0
    lost_leases: int = 0
    backend_errors: int = 0
    read_rejections: int = 0
    problems: list[str] = field(default_factory=list)
    report_dir: Path | None = None

    @property
    def acquisitions(self) -> int:
        return len(self.holds)

    @property
    def accepted(self) -> int:
        return sum(w.accepted for w in self.writes)

    @property
    def rejected(self) -> int:
        """Writes the fence turned away (stale tokens): each one an update saved."""
        return sum(not w.accepted for w in self.writes)

    @property
    def lost_updates(self) -> int:
        """Accepted increments the register does not show."""
        return max(0, max(self.applied, self.accepted) - self.final)

    @property
    def overlaps(self) -> int:
        """Times two workers *believed* they held the lock at once (harmless with the fence)."""
        return len(overlaps(self.holds))

    @property
    def rejected_after_restart(self) -> int:
        """Stale writes the fence rejected while a lock server was down, or within 2 ttl
        of its restart: the holders a server kill cut off, still writing. A paused
        worker's late write is the pause's, not counted here."""
        windows = [(down, back + 2 * self.ttl) for down, back in self.outages]
        pauses = [f for f in self.faults if f.kind == "pause"]
        return sum(
            not w.accepted
            and any(a <= w.at <= b for a, b in windows)
            and not any(f.target == w.worker and f.start <= w.at <= f.end for f in pauses)
            for w in self.writes
        )

    @property
    def double_grants(self) -> int:
        """Names granted to a worker while another (not paused) still held them, during a
        failover: the split brain ``wait_replicas`` prevents and the fence makes harmless."""
        windows = [(f.start, f.end + 2 * self.ttl) for f in self.faults if f.kind == "failover"]
        pauses = [f for f in self.faults if f.kind == "pause"]
        return sum(
            any(lo <= b.start <= hi for lo, hi in windows)
            and not any(f.target == a.worker and f.start <= b.start <= f.end for f in pauses)
            for a, b in overlaps(self.holds)
        )

    @property
    def ok(self) -> bool:
        """Fencing on, nothing lost, tokens in order: the only passing verdict."""
        return self.fence and not self.problems

    def counters(self) -> dict[str, int]:
        return {
            "faults injected": len(self.faults),
            "lock server kills": len(self.outages),
            "acquisitions": self.acquisitions,
            "leases lost": self.lost_leases,
            "believed overlaps": self.overlaps,
            "double grants in a failover": self.double_grants,
            "writes accepted": max(self.applied, self.accepted),
            "stale writes rejected": self.rejected,
            "stale reads rejected": self.read_rejections,
            "rejected after a server restart": self.rejected_after_restart,
            "register (final)": self.final,
            "lost updates": self.lost_updates,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "url": self.url,
            "fence": self.fence,
            "workers": self.workers,
            "duration": self.duration,
            "ttl": self.ttl,
            "start": self.start,
            "end": self.end,
            "ok": self.ok,
            "counters": self.counters(),
            "problems": self.problems,
            "skipped": self.skipped,
            "faults": [f.to_json() for f in self.faults],
        }


#: Token-order problems listed one by one; the rest are counted.
MAX_LISTED = 5


def judge(report: DrillReport) -> None:
    problems = report.problems
    if report.lost_updates:
        problems.append(
            f"{report.lost_updates} of {max(report.applied, report.accepted)} accepted updates "
            "were lost "
            f"(the register reads {report.final})"
        )
    # In the store's own order (the value each accepted write carried), tokens must rise.
    accepted = sorted(
        ((v, w.at, w) for v, w in zip(report.values, report.writes, strict=True) if w.accepted),
        key=lambda x: (x[0], x[1]),
    )
    for (_, _, a), (_, _, b) in itertools.pairwise(accepted):
        if not b.token > a.token:
            problems.append(
                f"accepted writes out of token order: {a.worker} wrote with {a.token}, "
                f"then {b.worker} with {b.token}"
            )
    disorder = [
        f"tokens did not increase: {a.worker} held {a.token} from {a.start:.6f}, then "
        f"{b.worker} asked at {sent:.6f} and got {b.token}"
        for a, b, sent in holds_out_of_order(report.holds, report.sent)
    ]
    if len(disorder) > MAX_LISTED:  # a split brain: every hold on the old primary
        more = len(disorder) - MAX_LISTED
        disorder = [*disorder[:MAX_LISTED], f"... and {more} more holds with tokens out of order"]
    problems += disorder


def holds_out_of_order(
    holds: Sequence[Hold], sent: Sequence[float]
) -> list[tuple[Hold, Hold, float]]:
    """(a, b, b's send) where ``a`` was granted before ``b`` was asked for, yet ``b``'s token
    is not larger (G2).

    A hold's ``start`` is stamped after its acquire returned, so its grant came before; a
    hold's grant came after the send of the attempt that got it. Only those two order
    holds: a worker starved of CPU right after its grant stamps a late ``start``, and by
    ``start`` alone it would seem to come after a successor that in fact came later.
    """
    known = [(h, t) for h, t in zip(holds, sent, strict=True) if h.token is not None]
    by_start = sorted((h for h, _ in known), key=lambda h: h.start)
    starts = [h.start for h in by_start]
    # top[k]: the largest token among the k + 1 earliest starts, and its hold.
    top: list[tuple[int, Hold]] = []
    for h in by_start:
        assert h.token is not None
        top.append((h.token, h) if not top or h.token > top[-1][0] else top[-1])
    found = []
    for b, asked in known:
        assert b.token is not None
        k = bisect.bisect_left(starts, asked)
        if k and top[k - 1][0] >= b.token:
            found.append((top[k - 1][1], b, asked))
    return found


# -- the HTML page ------------------------------------------------------------------------

LANE_H, LEFT, RIGHT, TOP, WIDTH = 34, 70, 20, 30, 1200
FAULT_COLORS = {
    "pause": "#7b61ff",
    "partition": "#ff8c00",
    "kill": "#222222",
    "clock": "#1e90ff",
    "restart": "#8b4513",
    "failover": "#c71585",
}


def _x(t: float, t0: float, span: float) -> float:
    """The x of time ``t``; what happened before the drill's start (workers already looping
    while the last ones started) is drawn at its left edge."""
    return LEFT + max(0.0, t - t0) / span * (WIDTH - LEFT - RIGHT)


def render_svg(report: Any) -> str:
    t0, t1 = report.start, max(report.end, report.start + 1e-3)
    span = t1 - t0
    lanes = sorted(
        {f"w{i + 1}" for i in range(report.workers)} | {h.worker for h in report.holds},
        key=lambda w: (len(w), w),
    )
    y = {w: TOP + i * LANE_H for i, w in enumerate(lanes)}
    height = TOP + len(lanes) * LANE_H + 30
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="timeline" width="{WIDTH}" '
        f'height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">'
    ]
    # Time axis: a tick per second (or per tenth, for short drills).
    step = 1.0 if span > 4 else 0.1 if span < 1 else 0.5
    tick = 0.0
    while tick <= span:
        x = _x(t0 + tick, t0, span)
        out.append(
            f'<line x1="{x:.1f}" y1="{TOP - 8}" x2="{x:.1f}" y2="{height - 24}" stroke="#eee"/>'
        )
        out.append(
            f'<text x="{x:.1f}" y="{height - 10}" text-anchor="middle" fill="#666">{tick:g}s</text>'
        )
        tick = round(tick + step, 6)
    for fault in report.faults:
        x0, x1 = _x(fault.start, t0, span), _x(max(fault.end, fault.start), t0, span)
        color = FAULT_COLORS.get(fault.kind, "#999")
        lane_y = y.get(fault.target)
        ys, hs = (lane_y - 4, LANE_H - 6) if lane_y is not None else (TOP - 8, height - TOP - 16)
        title = escape(f"{fault.kind} {fault.target}: {fault.detail}")
        out.append(
            f'<g class="fault" data-fault="{escape(fault.kind)}" '
            f'data-target="{escape(fault.target)}">'
            f"<title>{title}</title>"
            f'<rect x="{x0:.1f}" y="{ys}" width="{max(3.0, x1 - x0):.1f}" height="{hs}" '
            f'fill="{color}" fill-opacity="0.18" stroke="{color}" stroke-dasharray="3 2"/>'
            f'<text x="{x0 + 2:.1f}" y="{ys + 10}" fill="{color}" font-size="10">'
            f"{escape(fault.kind)}</text></g>"
        )
    for w in lanes:
        out.append(f'<g class="lane" data-worker="{escape(w)}">')
        out.append(f'<text x="8" y="{y[w] + 16}" font-weight="bold">{escape(w)}</text>')
        out.append(
            f'<line x1="{LEFT}" y1="{y[w] + 12}" x2="{WIDTH - RIGHT}" y2="{y[w] + 12}" '
            'stroke="#ccc"/>'
        )
        for h in (h for h in report.holds if h.worker == w):
            x0, x1 = _x(h.start, t0, span), _x(h.end, t0, span)
            out.append(
                f'<rect class="lease" data-token="{h.token}" x="{x0:.1f}" y="{y[w] + 4}" '
                f'width="{max(1.0, x1 - x0):.2f}" height="16" fill="#8fbc8f" stroke="#2e8b57" '
                f'stroke-width="0.5"><title>{escape(w)} held token {h.token} for '
                f"{(h.end - h.start) * 1000:.0f} ms</title></rect>"
            )
        for wr, late in zip(report.writes, report.late, strict=True):
            if wr.worker != w:
                continue
            x = _x(wr.at, t0, span)
            cls, fill, r = (
                ("write accepted", "#2e8b57", 2.5)
                if wr.accepted
                else ("write rejected", "#d62728", 6)
            )
            verdict = "accepted" if wr.accepted else "REJECTED (stale token)"
            out.append(
                f'<circle class="{cls}" data-token="{wr.token}" cx="{x:.1f}" cy="{y[w] + 12}" '
                f'r="{r}" fill="{fill}" stroke="#fff" stroke-width="0.5"><title>{escape(w)} '
                f"{'late write' if late else 'write'} token {wr.token}: {verdict}</title></circle>"
            )
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out)


def _table(title: str, head: list[str], rows: list[list[str]], cls: str) -> str:
    th = "".join(f"<th>{escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f'<h2>{escape(title)}</h2><table class="{cls}"><tr>{th}</tr>{body}</table>'


def render_html(report: Any) -> str:
    counters = report.counters()
    verdict = (
        "PASS: nothing was lost"
        if report.ok
        else "NO FENCE: " + f"{report.lost_updates} update(s) lost"
        if not report.fence
        else "FAIL: " + "; ".join(report.problems)
    )
    faults = [
        [
            f"{(f.start - report.start) * 1000:.0f}",
            f"{f.lasted * 1000:.0f}",
            f.kind,
            f.target,
            f.detail,
        ]
        for f in report.faults
    ]
    problems = "".join(f"<li>{escape(p)}</li>" for p in report.problems) or "<li>none</li>"
    # The kinds of fault this run made, not every kind there is (nor those it skipped).
    made = {f.kind for f in report.faults}
    kinds = [k for k in FAULT_COLORS if k in made] + sorted(made - FAULT_COLORS.keys())
    legend = " ".join(
        f'<span class="fault-key" data-fault="{escape(k)}" '
        f'style="color:{FAULT_COLORS.get(k, "#999")}">&#9632; {escape(k)}</span>'
        for k in kinds
    )
    skipped = (
        '<p class="skipped">Not made here: ' + escape("; ".join(report.skipped)) + "</p>"
        if report.skipped
        else ""
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>asynclock drill: {escape(report.backend)}</title>
<style>
body {{ font-family: sans-serif; margin: 24px; color: #222; }}
table {{ border-collapse: collapse; margin-bottom: 16px; }}
td, th {{ border: 1px solid #ccc; padding: 3px 10px; text-align: left; }}
.verdict {{ font-size: 20px; font-weight: bold; color: {"#2e8b57" if report.ok else "#d62728"}; }}
.legend span {{ margin-right: 14px; }}
</style></head><body>
<h1>asynclock drill</h1>
<p class="verdict" id="verdict">{escape(verdict)}</p>
<p>backend <code>{escape(report.backend)}</code> &middot; {report.workers} workers &middot;
{report.duration:g} s &middot; lease ttl {report.ttl:g} s &middot;
fence {"on" if report.fence else "OFF"}</p>
<h2>Timeline</h2>
<p class="legend"><span style="color:#2e8b57">&#9644; lease held</span>
<span style="color:#2e8b57">&#9679; write accepted</span>
<span style="color:#d62728">&#11044; write rejected (stale token)</span> {legend}</p>
{render_svg(report)}
{_table("Summary", ["", "count"], [[k, str(v)] for k, v in counters.items()], "summary")}
{_table("Faults injected", ["t (ms)", "lasted (ms)", "fault", "target", "what"], faults, "faults")}
{skipped}
<h2>Problems</h2><ul class="problems">{problems}</ul>
</body></html>
"""
