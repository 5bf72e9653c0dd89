"""What workers did, and the checker that says whether the lock kept its promises.

A history is a list of :class:`Hold` (a worker believed it held a name from ``start`` to
``end``, with a fencing token) and :class:`Write` (a worker sent a write with a token to a
fenced resource, which accepted or rejected it). Times are ``time.monotonic()`` readings,
system-wide on Linux, so holds from several processes compare. Each record reads from and
writes to one JSON object, so a history can be kept as JSON lines.

:func:`write_jsonl` and :func:`read_jsonl` keep a history in a file, one record a line.

The checks, each returning what it found (empty: it held):

* :func:`overlaps` — holds of one name by different workers that overlap in time (G1);
* :func:`tokens_out_of_order` — a later hold with a token not above an earlier one's (G2);
* :func:`stale_writes` — accepted writes whose token is below one the resource had already
  accepted (G8: the fence must reject them);
* :func:`lost_updates` — increments that a read-modify-write counter does not show.

:func:`check` runs all of them and says what went wrong, one line per problem.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Hold:
    """``worker`` believed it held ``name`` from ``start`` to ``end`` (token if known).

    For the trace check (:mod:`.trace_check`): ``sent``, when the attempt that got the hold
    was sent (its grant came after), and ``ended``, how the hold ended: ``"released"`` (the
    lease was never lost), ``"lost"``, ``"error"`` (a backend error), or ``""`` (unknown).
    """

    worker: str
    start: float
    end: float
    token: int | None = None
    name: str = ""
    sent: float | None = None
    ended: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"kind": "hold", **asdict(self)}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Hold:
        token, sent = raw.get("token"), raw.get("sent")
        return cls(
            str(raw["worker"]),
            float(raw["start"]),
            float(raw["end"]),
            None if token is None else int(token),
            str(raw.get("name", "")),
            None if sent is None else float(sent),
            str(raw.get("ended", "")),
        )


@dataclass(frozen=True)
class Write:
    """``worker`` sent a write with ``token`` at ``at``; the fenced resource ``accepted`` it.

    For the trace check: ``value``, the value it carried (the drill's register counts, so
    accepted values give the store's own order of its writes), and ``late``: sent after its
    lease was lost (the paused holder's write on its way).
    """

    worker: str
    at: float
    token: int
    accepted: bool
    key: str = ""
    value: int | None = None
    late: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"kind": "write", **asdict(self)}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Write:
        value = raw.get("value")
        return cls(
            str(raw["worker"]),
            float(raw["at"]),
            int(raw["token"]),
            bool(raw["accepted"]),
            str(raw.get("key", "")),
            None if value is None else int(value),
            bool(raw.get("late", False)),
        )


def write_jsonl(path: Path, records: Iterable[Hold | Write]) -> None:
    """Append ``records`` to ``path``, one JSON object a line."""
    with path.open("a", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record.to_json()) + "\n")


def read_jsonl(path: Path) -> tuple[list[Hold], list[Write]]:
    """The holds and writes kept in ``path`` by :func:`write_jsonl`."""
    holds: list[Hold] = []
    writes: list[Write] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        raw = json.loads(line)
        if raw.get("kind") == "hold":
            holds.append(Hold.from_json(raw))
        elif raw.get("kind") == "write":
            writes.append(Write.from_json(raw))
        else:
            raise ValueError(f"{path}:{number}: not a hold or write record: {line[:80]!r}")
    return holds, writes


def overlaps(holds: Iterable[Hold]) -> list[tuple[Hold, Hold]]:
    """Pairs (earlier, later) of one name's holds by different workers that overlap.

    A hold overlaps when it starts before another worker's earlier hold has ended; each
    such hold is reported once, with the earlier hold that ends last.
    """
    found: list[tuple[Hold, Hold]] = []
    by_name = sorted(holds, key=lambda h: (h.name, h.start, h.end))
    for _, group in itertools.groupby(by_name, key=lambda h: h.name):
        longest: Hold | None = None
        for hold in group:
            if longest is not None and hold.start < longest.end and hold.worker != longest.worker:
                found.append((longest, hold))
            if longest is None or hold.end > longest.end:
                longest = hold
    return found


def tokens_out_of_order(holds: Iterable[Hold]) -> list[tuple[Hold, Hold]]:
    """Pairs (earlier, later) of one name's consecutive holds whose tokens did not increase."""
    found: list[tuple[Hold, Hold]] = []
    known = sorted((h for h in holds if h.token is not None), key=lambda h: (h.name, h.start))
    for _, group in itertools.groupby(known, key=lambda h: h.name):
        for a, b in itertools.pairwise(group):
            assert a.token is not None and b.token is not None
            if not b.token > a.token:
                found.append((a, b))
    return found


def stale_writes(writes: Iterable[Write]) -> list[Write]:
    """Accepted writes whose token is below one already accepted for the same key."""
    found: list[Write] = []
    mark: dict[str, int] = {}
    for write in sorted(writes, key=lambda w: w.at):
        if not write.accepted:
            continue
        if write.token < mark.get(write.key, write.token):
            found.append(write)
        else:
            mark[write.key] = write.token
    return found


def lost_updates(increments: int, final: int) -> int:
    """How many of ``increments`` read-modify-write updates a counter at ``final`` lost."""
    return max(0, increments - final)


def check(
    holds: Sequence[Hold] = (),
    writes: Sequence[Write] = (),
    *,
    increments: int | None = None,
    final: int | None = None,
) -> list[str]:
    """Every problem in the history, one line each; empty when the lock kept its promises."""
    problems = [
        f"{b.worker} held {b.name or 'the lock'} from {b.start:.6f} while {a.worker} held it "
        f"until {a.end:.6f}"
        for a, b in overlaps(holds)
    ]
    problems += [
        f"tokens did not increase: {a.worker} held {a.token}, then {b.worker} got {b.token}"
        for a, b in tokens_out_of_order(holds)
    ]
    problems += [
        f"{w.worker}'s write with stale token {w.token} was accepted at {w.at:.6f}"
        for w in stale_writes(writes)
    ]
    if increments is not None and final is not None and (lost := lost_updates(increments, final)):
        problems.append(f"{lost} of {increments} updates were lost (the counter reads {final})")
    return problems
