"""The drill's report as ONE self-contained HTML page: an SVG timeline plus the tables.

No scripts, no external resources. The timeline has one lane per worker (``g.lane``,
``data-worker``), a bar per hold (``rect.lease``, red-edged when the hold ended in a lost
lease), a mark per write (``circle.write``: green accepted, red ``rejected``), and one
marker per fault (``g.fault``, ``data-fault``) spanning its time. Tests and browsers find
them by these classes.
"""

from __future__ import annotations

from html import escape
from typing import Any

LANE_H, LEFT, RIGHT, TOP, WIDTH = 34, 70, 20, 30, 1200
FAULT_COLORS = {"pause": "#7b61ff", "partition": "#ff8c00", "kill": "#222222", "clock": "#1e90ff"}


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
            f"{(f.end - f.start) * 1000:.0f}",
            f.kind,
            f.target,
            f.detail,
        ]
        for f in report.faults
    ]
    problems = "".join(f"<li>{escape(p)}</li>" for p in report.problems) or "<li>none</li>"
    legend = " ".join(
        f'<span style="color:{c}">&#9632; {k}</span>' for k, c in FAULT_COLORS.items()
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
<h2>Problems</h2><ul class="problems">{problems}</ul>
</body></html>
"""
