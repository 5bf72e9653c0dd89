"""A process's owner label (``connect(url, owner_label=...)``, default ``host:pid``).

Holder ids are random hex: nobody can tell from one which process holds a lock. The label
says it, the way kazoo's lock identifier does. It travels in the owner string the server
already stores, ``<owner id, 32 hex>~<label as UTF-8 hex>`` (before a leadership term's
``.<identity hex>``), so no driver stores anything new and every owner comparison stays
exact on the whole string: another process reads the label back from
:attr:`Holder.owner <asynclock.Holder>` (``Holder.label``). Hex, as the leader's identity,
so that every server stores it as it stores any owner and no label can forge a mark.
"""

from __future__ import annotations

import os
import socket

#: Between the owner id and the encoded label (never a hex digit, nor the identity mark).
LABEL_MARK = "~"
MAX_LABEL_BYTES = 100


def default_owner_label() -> str:
    """``host:pid``, the host name cut to fit :data:`MAX_LABEL_BYTES`."""
    pid = f":{os.getpid()}"
    host = socket.gethostname().encode("utf-8", "replace")[: MAX_LABEL_BYTES - len(pid)]
    label = host.decode("utf-8", "ignore") + pid
    return label if label.isprintable() else f"pid{pid}"


def check_owner_label(label: object) -> str:
    """``label`` if it is a valid owner label (the default for None), else an error saying
    what is allowed."""
    if label is None:
        return default_owner_label()
    if not isinstance(label, str):
        raise TypeError(f"owner_label must be a str or None, not {type(label).__name__}")
    try:
        size = len(label.encode("utf-8"))
    except UnicodeEncodeError:
        size = -1
    if not 0 < size <= MAX_LABEL_BYTES or not label.isprintable():
        raise ValueError(
            f"owner_label must be 1 to {MAX_LABEL_BYTES} bytes of UTF-8 with no control "
            f"or other non-printable characters (such as 'worker-3' or 'host:1234'), "
            f"got {label!r}"
        )
    return label


def label_tag(label: str) -> str:
    """What follows the owner id in every owner string of this process."""
    return LABEL_MARK + label.encode("utf-8").hex()


def label_of(owner: str | None) -> str | None:
    """The label in a stored owner string, or None (no label: another client's owner, a
    PostgreSQL session-mode lock of another session, an asynclock before labels)."""
    if not owner:
        return None
    _, mark, rest = owner.partition(LABEL_MARK)
    if not mark:
        return None
    encoded = rest.partition(".")[0]  # a leadership term's identity follows
    try:
        return bytes.fromhex(encoded).decode("utf-8") or None
    except ValueError:
        return None
