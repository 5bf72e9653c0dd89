"""What ``asynclock holder NAME`` shows beyond the lock: the live permits of the semaphore
``NAME`` and the holds of the read-write lock ``NAME`` (separate namespaces on the server:
a name may be all three at once), as ``sem.holders()`` and ``rw.holders()`` see them.

A backend without semaphores or read-write locks, or one that cannot list them, answers
NotImplementedError: shown as one plain note, never as a failure of the command."""

from __future__ import annotations

from typing import Any

import asynclock

from .._core.listing import HOLD_KINDS
from .._core.owner_label import LABEL_MARK
from .output import Output


async def holds_of(backend: asynclock.Backend, name: str) -> tuple[list[asynclock.Holder], str]:
    """The live permits, then the read-write holds, of ``name``; and a note ("" if none)
    saying what this backend cannot list."""
    found: list[asynclock.Holder] = []
    notes: list[str] = []
    try:
        # The limit is not checked by holders(): every live permit, whatever its limit.
        found += await backend.semaphore(name, 1).holders()
    except NotImplementedError as exc:
        notes.append(str(exc))
    try:
        found += await backend.rwlock(name).holders()
    except NotImplementedError as exc:
        notes.append(str(exc))
    return found, "; ".join(dict.fromkeys(notes))


async def list_all(
    backend: asynclock.Backend, pattern: str, limit: int
) -> tuple[list[asynclock.Holder], str]:
    """``asynclock list``: the held locks, permits and read-write holds matching
    ``pattern`` (by name, a name's lock first; at most ``limit``), and a note ("" if none)
    saying what this backend cannot list. NotImplementedError if it can list none."""
    found: list[asynclock.Holder] = []
    notes: list[str] = []
    for kinds in (("lock",), HOLD_KINDS):
        try:
            found += await backend.holders(pattern, limit=limit, kinds=kinds)
        except NotImplementedError as exc:
            notes.append(str(exc))
    if len(notes) == 2:
        raise NotImplementedError(notes[0])
    return sorted(found, key=lambda h: h.name)[:limit], "; ".join(notes)


def hold_json(held: asynclock.Holder) -> dict[str, Any]:
    """One permit or read-write hold for ``--json``."""
    return {
        "kind": held.kind,
        "slot": held.slot,
        "limit": held.limit,
        "owner": held.owner,
        "label": held.label,
        "token": held.token,
        "ttl_left": None if held.remaining is None else round(held.remaining, 3),
    }


def _who(held: asynclock.Holder) -> str:
    owner = held.owner or "unknown"
    if held.label is not None:
        owner = f"{owner.partition(LABEL_MARK)[0]} ({held.label})"
    return owner


def describe_hold(held: asynclock.Holder) -> str:
    """One line on a permit or a read-write hold, as an operator reads it."""
    if held.remaining is None:  # ZooKeeper: the node lives as long as its holder's session
        left = "; no expiry at the server (held while its holder's session lives)"
    else:
        left = f"; ends in {held.remaining:.1f}s unless renewed"
    if held.kind == "permit":
        return f"slot {held.slot}: held by owner {_who(held)}, token {held.token}{left}"
    if held.kind == "write":
        return f"writer: owner {_who(held)}, writer epoch {held.token}{left}"
    if held.kind == "read":
        return f"reader: owner {_who(held)}, reads epoch {held.token}{left}"
    return f"waiting writer: owner {_who(held)} (new readers wait behind it){left}"


def show_holds(out: Output, holds: list[asynclock.Holder]) -> None:
    """The permits and read-write holds, one paragraph each, under a heading per kind."""
    permits = [h for h in holds if h.kind == "permit"]
    rw = [h for h in holds if h.kind != "permit"]
    if permits:
        limit = permits[0].limit
        of = "" if limit is None else f" of limit {limit}"
        out.line([(f"  semaphore: {len(permits)} permit(s) held{of}", "")])
        for held in permits:
            out.paragraph([(describe_hold(held), "")], "    ", "      ")
    if rw:
        out.line([("  read-write lock:", "")])
        for held in rw:
            out.paragraph([(describe_hold(held), "")], "    ", "      ")
