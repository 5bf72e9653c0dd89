"""The replies (and arguments) of the scripts both Redis drivers run: the restart grace
argument, the batched extend, the holder query; and ``INFO``'s."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ..._core.driver import ExtendResult, LeaseRef, Refused
from ..._core.holder import Holder
from .keys import KeyCache
from .wire import ms


def grace_ms(restart_grace: float | None, ttl_ms: int) -> bytes:
    """ARGV ``grace_ms`` of the acquire scripts."""
    if restart_grace is None:
        return b"%d" % ttl_ms
    return b"%d" % math.ceil(restart_grace * 1000)


def extend_call(keys: KeyCache, leases: Sequence[LeaseRef]) -> tuple[list[bytes], list[bytes]]:
    """KEYS and ARGV of the batched ``extend`` script: per lease its lock key, and
    ``owner:token`` plus the ttl in ms."""
    args: list[bytes] = []
    for ref in leases:
        args.append(f"{ref.owner}:{ref.token}".encode())
        args.append(b"%d" % ms(ref.ttl))
    return [keys(ref.name).lock for ref in leases], args


def extend_result(code: int) -> ExtendResult:
    if code == 1:
        return True
    if code == 0:
        return Refused("the lock key is gone (expired or deleted)")
    return Refused("the lock is held by another owner")


def holder_from_reply(name: str, reply: Any) -> Holder | None:
    """A HOLDER script reply (``[b"owner:token", pttl_ms]``, ``[b"", ms_left, end_ms]`` in
    the restart grace, or ``[]``) as a Holder."""
    if not reply:
        return None
    if len(reply) == 3:  # the restart grace: nobody known holds it, nothing is granted
        return Holder(name, None, None, int(reply[1]) / 1000, int(reply[2]) / 1000)
    value, pttl = bytes(reply[0]), int(reply[1])
    token = token_of(value)
    # A value not in asynclock's "owner:token" form (another tool's key): no token, and
    # the whole value stands for the owner.
    owner = value.rpartition(b":")[0] if token is not None else value
    # PTTL -1: a key with no expiry (not asynclock's): its remaining time is unknown.
    return Holder(name, owner.decode("utf-8", "replace"), token, pttl / 1000 if pttl >= 0 else None)


def token_of(value: bytes) -> int | None:
    head, sep, tail = value.rpartition(b":")
    if not sep or not head or value.startswith(b"~"):
        return None
    try:
        return int(tail)
    except ValueError:
        return None


def info_fields(info: object) -> dict[str, str]:
    """An ``INFO`` reply as ``{field: value}``."""
    text = info.decode(errors="replace") if isinstance(info, bytes) else str(info)
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and not line.startswith("#"):
            out[key.strip()] = value.strip()
    return out
