"""The pure rules of :mod:`.partitions`: names, the key hash, the quota, input checks.

Kept apart from the member's state machine so each can be read (and tested) alone.
"""

from __future__ import annotations

import hashlib

from .validation import check_lease_ttl, check_name, check_not_reserved

#: The most partitions a group may have: each is a lease renewed in the backend's batch
#: and tried one by one by a member below its quota.
MAX_PARTITIONS = 10_000
MEMBER_PART = "/member/"
PARTITION_PART = "/partition/"
#: A member id: uuid4 hex.
MEMBER_ID_LENGTH = 32


def partition_of(key: str | bytes, count: int) -> int:
    """The partition of ``key`` among ``count`` (``0 .. count-1``): the first 8 bytes of
    the BLAKE2b digest (``digest_size=8``) of the key's UTF-8 bytes, as a big-endian
    unsigned int, modulo ``count``. The same in every process, platform and Python version
    (not ``hash()``, which is salted per process), so a producer routes a key without
    joining the group: ``asynclock.partition_of(key, count)`` is what the group's members
    compute (``member.partition_of(key)``) for the same ``count``.

    ``count`` is a positive int (not a bool): TypeError / ValueError otherwise; ``key`` a
    ``str`` or ``bytes``: TypeError otherwise."""
    if type(count) is not int:
        raise TypeError(f"count must be a positive int, got {type(count).__name__} {count!r}")
    if count < 1:
        raise ValueError(f"count must be a positive int, got {count!r}")
    if isinstance(key, str):
        data = key.encode("utf-8")
    elif isinstance(key, bytes | bytearray | memoryview):
        data = bytes(key)
    else:
        raise TypeError(f"a partition key must be a str or bytes, not {type(key).__name__}")
    digest = hashlib.blake2b(data, digest_size=8).digest()
    return int.from_bytes(digest, "big") % count


def quota(count: int, members: list[str], me: str) -> int:
    """How many partitions ``me`` should own: ``members`` sorted, the first
    ``count mod n`` own ⌈count/n⌉, the others ⌊count/n⌋ (the quotas sum to ``count``)."""
    ranked = sorted(set(members) | {me})
    base, extra = divmod(count, len(ranked))
    return base + (1 if ranked.index(me) < extra else 0)


def glob_escape(text: str) -> str:
    """``text`` as a glob matching only itself (``backend.holders`` patterns)."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in text)


def is_member_id(text: str) -> bool:
    """Whether ``text`` is a member id: uuid4 hex, as ``PartitionMember.id`` makes them."""
    return len(text) == MEMBER_ID_LENGTH and all(c in "0123456789abcdef" for c in text)


def member_name(group: str, member: str) -> str:
    return f"{group}{MEMBER_PART}{member}"


def partition_name(group: str, partition: int) -> str:
    return f"{group}{PARTITION_PART}{partition}"


def check_count(count: object) -> int:
    if type(count) is not int:  # not a bool, not a float
        raise TypeError(
            f"count must be an int from 1 to {MAX_PARTITIONS}, got {type(count).__name__} {count!r}"
        )
    if not 1 <= count <= MAX_PARTITIONS:
        raise ValueError(f"count must be an int from 1 to {MAX_PARTITIONS}, got {count!r}")
    return count


def check_group(group: object, count: int) -> str:
    """A group name: a valid lock name, short enough that every name made from it (its
    members' and its partitions') is one too."""
    name = check_not_reserved(check_name(group))
    longest = max(
        member_name(name, "0" * MEMBER_ID_LENGTH), partition_name(name, count - 1), key=len
    )
    try:
        check_name(longest)
    except ValueError:
        raise ValueError(
            f"group name {name[:40]!r}... is too long: its locks ({longest[:60]!r}...) must "
            "be valid lock names (at most 512 UTF-8 bytes)"
        ) from None
    return name


def check_partition_args(group: object, count: object, ttl: object) -> tuple[str, int, float]:
    checked = check_count(count)
    return check_group(group, checked), checked, check_lease_ttl(ttl)
