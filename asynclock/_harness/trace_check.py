"""Replay a drill's history against the invariants the Spin models check (docs/proved.md).

``asynclock drill`` keeps its history as JSON lines (``history.jsonl``: :class:`~.history.Hold`
and :class:`~.history.Write` records). :func:`check_file` reads one back and
:func:`check_trace` checks it, so a real run is held to the statements the models prove,
over the run's own events:

* **G1** (``lease.pml``, ``redlock.pml``: one holder at the server) — no grant while another
  worker's lease must still be live at the server. Hold A was granted after ``A.sent`` for
  ``ttl``, so the server keeps it at least until ``A.sent + ttl`` unless it is released; a
  hold B of another worker asked for after A began (``B.sent >= A.start``) and begun before
  A ended and before that bound (``B.start < min(A.end, A.sent + ttl)``) was granted while A
  held it. Holds that merely *believed* they overlapped (a paused holder whose lease had
  expired) are not this: the paused hold's lease ended at the server first. Nor is A a hold
  whose end is unknown (``ended`` empty: its worker was killed, the drill closed the hold at
  the kill, and a release it had sent may have been in flight): that end is a bound only.
* **G2** (``lease.pml`` ``ctr > maxtok``, ``redlock.pml``) — a grant's token is above every
  token of a hold of the same name that began before the grant was asked for.
* **G3** (``fence.pml`` ``tok >= newest``, ``redlock.pml``) — in the fenced resource's own
  order of its writes (the drill's register counts: an accepted write's value is its place),
  no write lands with a token below one that landed before it (equal: only the same worker's).

Each check needs the fields the drill records for it (``sent``, ``ended``, ``value``); a
record without them is not judged by that check. Times are ``time.monotonic()`` readings.
A sound check says only what the events prove: the clocks of the servers may run up to
``drift`` slower than the workers' (the contract's 1 %).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from pathlib import Path

from .history import Hold, Write, read_jsonl

#: The clock rate difference the contract allows (G3: the drift bound).
DRIFT = 0.01


def double_grants(holds: Sequence[Hold], ttl: float) -> list[tuple[Hold, Hold]]:
    """(a, b): b, another worker's hold of a's name, was granted while a's lease was live (G1)."""
    found: list[tuple[Hold, Hold]] = []
    life = ttl * (1 - DRIFT)
    known = sorted((h for h in holds if h.sent is not None), key=lambda h: (h.name, h.sent))
    for _, group in itertools.groupby(known, key=lambda h: h.name):
        same = list(group)
        sents = [h.sent for h in same if h.sent is not None]
        for b in same:
            assert b.sent is not None
            # Candidates a: asked for within ttl before b began (a.sent > b.start - ttl),
            # and not after b was (a.sent <= a.start <= b.sent).
            first = bisect.bisect_right(sents, b.start - life)
            last = bisect.bisect_right(sents, b.sent)
            for a in same[first:last]:
                assert a.sent is not None
                if a is b or a.worker == b.worker or not a.ended:
                    continue  # an unknown end (a killed worker's) is only an upper bound
                if a.start <= b.sent and b.start < min(a.end, a.sent + life):
                    found.append((a, b))
    return found


def tokens_not_rising(holds: Sequence[Hold]) -> list[tuple[Hold, Hold]]:
    """(a, b): a began before b was asked for, yet b's token is not above a's (G2)."""
    found: list[tuple[Hold, Hold]] = []
    known = sorted(
        (h for h in holds if h.token is not None and h.sent is not None),
        key=lambda h: (h.name, h.start),
    )
    for _, group in itertools.groupby(known, key=lambda h: h.name):
        same = list(group)
        starts = [h.start for h in same]
        top: list[Hold] = []  # top[k]: the hold with the largest token among the k+1 first
        for h in same:
            assert h.token is not None
            best = top[-1].token if top else None
            top.append(h if best is None or h.token > best else top[-1])
        for b in same:
            assert b.sent is not None and b.token is not None
            k = bisect.bisect_left(starts, b.sent)
            if k:
                a = top[k - 1]
                assert a.token is not None
                if a is not b and a.token >= b.token:
                    found.append((a, b))
    return found


def stale_landed(writes: Sequence[Write]) -> list[tuple[Write, Write]]:
    """(a, b): b landed after a in the resource's order with an older token (G3)."""
    found: list[tuple[Write, Write]] = []
    landed = sorted(
        (w for w in writes if w.accepted and w.value is not None),
        key=lambda w: (w.key, w.value, w.at),
    )
    for _, group in itertools.groupby(landed, key=lambda w: w.key):
        newest: Write | None = None
        for w in group:
            if newest is not None and (
                w.token < newest.token or (w.token == newest.token and w.worker != newest.worker)
            ):
                found.append((newest, w))
            elif newest is None or w.token >= newest.token:
                newest = w
    return found


def check_trace(
    holds: Sequence[Hold], writes: Sequence[Write], *, ttl: float | None = None
) -> list[str]:
    """Every violation of G1 (with ``ttl``), G2 and G3 in the history; empty when none."""
    problems: list[str] = []
    if ttl is not None:
        problems += [
            f"G1: {b.worker} was granted {b.name or 'the lock'} (token {b.token}, begun at "
            f"{b.start:.6f}) while {a.worker}'s lease (token {a.token}, asked for at "
            f"{a.sent:.6f}, held until {a.end:.6f}) was still live at the server"
            for a, b in double_grants(holds, ttl)
        ]
    problems += [
        f"G2: {b.worker} got token {b.token} for {b.name or 'the lock'}, not above {a.worker}'s "
        f"{a.token} granted before it asked (at {b.sent:.6f})"
        for a, b in tokens_not_rising(holds)
    ]
    problems += [
        f"G3: {b.worker}'s write with token {b.token}{' (late)' if b.late else ''} landed "
        f"after {a.worker}'s with token {a.token} (values {a.value}, {b.value})"
        for a, b in stale_landed(writes)
    ]
    return problems


def check_file(path: Path, *, ttl: float | None = None) -> list[str]:
    """:func:`check_trace` of the history kept in ``path`` (JSON lines)."""
    holds, writes = read_jsonl(path)
    return check_trace(holds, writes, ttl=ttl)
