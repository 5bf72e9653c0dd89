"""Lock names as znode paths, and which children of a lock's node are contenders.

A name ``a/b`` is the znode ``<prefix>/a/b`` (so kazoo's ``Lock(client, "/a/b")`` and
``backend.lock("a/b")`` share a node); in each ``/``-separated segment, ``%`` and the
characters ZooKeeper refuses in a path (controls, the surrogate and private use range,
which Java's UTF-16 makes of every character above U+FFFF, and U+FFF0-U+FFFF) are
percent-encoded, and a segment ``.`` or ``..``
is written ``%2E``/``%2E%2E``. A name with an empty segment (a leading, trailing or double
``/``) is one segment with every ``/`` encoded. The mapping is one-to-one.
"""

from __future__ import annotations

from urllib.parse import unquote

from ..._core.validation import RESERVED_PREFIX

#: Our node names: ``<owner id, 32 hex>__lock__<10-digit sequence>``, kazoo's own layout.
MARK = "__lock__"
#: A contender is any child whose name ends in a ZooKeeper sequence number: kazoo's Lock
#: (``__lock__``) and ReadLock (``__rlock__``), Curator's and aiozk's (``...-lock-``).
#: ZooKeeper appends the parent's counter as Java's ``%010d``: ten digits, or past 2**31 a
#: negative number whose sign counts in the width (``-000000001``, ``-1234567890``).


def _refused(ch: str) -> bool:
    code = ord(ch)
    return (
        ch in "%/"
        or code == 0
        or 0x01 <= code <= 0x1F
        or 0x7F <= code <= 0x9F
        or 0xD800 <= code <= 0xF8FF
        or code >= 0xFFF0  # Java sees code points above 0xFFFF as surrogate pairs
    )


def _quote(segment: str) -> str:
    if segment in (".", ".."):
        return "%2E" * len(segment)
    out: list[str] = []
    for ch in segment:
        if _refused(ch):
            out.extend(f"%{b:02X}" for b in ch.encode("utf-8", "surrogatepass"))
        else:
            out.append(ch)
    return "".join(out)


def lock_path(prefix: str, name: str) -> str:
    segments = name.split("/")
    encoded = "/".join(_quote(s) for s in segments) if all(segments) else _quote(name)
    return f"{prefix}/{encoded}"


def name_of(prefix: str, path: str) -> str:
    """The lock name of the lock node ``path`` (the inverse of :func:`lock_path`)."""
    return unquote(path[len(prefix) + 1 :], errors="surrogatepass")


def sequence(child: str) -> int | None:
    """The ZooKeeper sequence number ``child`` ends in, or None. Curator's ``-lock-``
    before ten digits is its prefix, not a sign: ``…-lock-0000000003`` is 3 (it was read
    as -3, so a Curator contender queued behind ours looked ahead of it: each waited for
    the other). A negative number has nine digits after its sign, or ten not starting
    with 0 after a prefix ending in ``-`` or ``_`` (``__lock__-1234567890``)."""
    tail = child[-10:]
    if len(tail) == 10 and tail.isascii() and tail.isdigit():
        if child[-11:-10] == "-" and tail[0] != "0" and (len(child) == 11 or child[-12] in "-_"):
            return -int(tail)
        return int(tail)
    digits = child[-9:]
    if child[-10:-9] == "-" and len(digits) == 9 and digits.isascii() and digits.isdigit():
        return -int(digits)
    return None


def ahead_of(children: list[str], mine: str) -> tuple[int, str | None, str | None]:
    """Where the contender ``mine`` stands among ``children``: how many contenders are
    ahead of it, the nearest of them (the one to watch) and the first (the holder). One
    pass, no sort: a waiter does this on every wake-up, and sorting 1,000 names took
    3.5 ms of CPU (issue 45: the hand-off cost grew with the number waiting)."""
    me = sequence(mine)
    if me is None:
        return 0, None, None
    count, nearest, near, first, low = 0, None, -(2**63), None, 2**63
    for child in children:
        tail = child[-10:]
        if tail.isdigit() and tail.isascii() and child[-11:-10] != "-":
            seq: int | None = int(tail)
        else:
            seq = sequence(child)
        if seq is None or seq >= me:
            continue
        count += 1
        if seq > near:
            near, nearest = seq, child
        if seq < low:
            low, first = seq, child
    return count, nearest, first


def contenders(children: list[str]) -> list[str]:
    """The contenders among ``children``, in queue order (lowest sequence first)."""
    found = [(seq, c) for c in children if (seq := sequence(c)) is not None]
    found.sort()
    return [c for _, c in found]


#: asynclock's own nodes (semaphores, read-write locks) are under
#: ``<prefix>/%00asynclock.<kind>/<name>``: no lock's path is there (a lock name may not
#: start with the reserved prefix), and the listing of lock names does not walk it.
RESERVED = _quote(RESERVED_PREFIX)
#: (The wipe marker, :data:`._era.MARKER`, is ``/%00asynclock.%2Ewipe``: ``%2E`` is never
#: written inside a segment, only as a whole one, so no name maps to it.)


def reserved_path(prefix: str, kind: str, name: str) -> str:
    """Where asynclock keeps the ``kind`` nodes of ``name`` (the whole name one segment:
    ``a/b`` and ``a`` never nest)."""
    return f"{prefix}/{RESERVED}{kind}/{_quote(name)}"


def node_name(owner: str) -> str:
    """A node name for an owner (its unique first 32 characters, as lock nodes)."""
    return _quote(owner[:32])
