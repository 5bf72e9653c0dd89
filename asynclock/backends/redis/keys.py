"""Key names: a lock name's keys and channel (all under one Redis Cluster hash tag), the
database's epoch key, and the key prefix they start with."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Keys:
    """The keys and channel of one lock name; all share the hash tag ``{name}``."""

    lock: str
    fence: str
    queue: str
    queue_exp: str
    channel: str


def hash_tag(name: str) -> str:
    """``name`` escaped so it is a valid, complete Redis Cluster hash tag (no braces)."""
    return name.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")


def scope_fence_key(scope: str, prefix: str = "asynclock:") -> bytes:
    """The fence counter of a token scope. Its own hash tag: on Redis Cluster a scoped
    acquire would touch two slots, so token scopes need a single node (or Redlock)."""
    return f"{prefix}scope:{{{hash_tag(scope)}}}:fence".encode()


def keys_for(name: str, prefix: str = "asynclock:") -> Keys:
    base = f"{prefix}{{{hash_tag(name)}}}"
    return Keys(base, base + ":fence", base + ":q", base + ":qx", base + ":released")


def name_of_key(key: bytes | str, prefix: str = "asynclock:") -> str | None:
    """The lock name whose lock key is ``key`` (``keys_for(name).lock``), else None (a
    name's other keys, a scope's, the epoch, another prefix's)."""
    text = key.decode("utf-8", "surrogatepass") if isinstance(key, bytes) else key
    if not (text.startswith(prefix + "{") and text.endswith("}")):
        return None
    tag = text[len(prefix) + 1 : -1]
    if "{" in tag or "}" in tag:
        return None
    return re.sub("%(25|7B|7D)", lambda m: _UNESCAPE[m.group(1)], tag)


_UNESCAPE = {"25": "%", "7B": "{", "7D": "}"}


def glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis glob pattern (SCAN MATCH, KEYS)."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def record_key(name: str, prefix: str = "asynclock:") -> bytes:
    """The idempotency record of ``name``: beside its lock key, in the same hash slot."""
    return f"{prefix}{{{hash_tag(name)}}}:record".encode()


def epoch_key(prefix: str = "asynclock:") -> str:
    """The database's epoch key (see ``grace_left``): no braces, so no lock name's key."""
    return f"{prefix}epoch"


def era_key(prefix: str = "asynclock:") -> str:
    """The database's era key (see ``ADOPT``): the replication id its data was written under."""
    return f"{prefix}era"


@dataclass(frozen=True, slots=True)
class WireKeys:
    """The keys of one name as the scripts take them (bytes), and its channel's name."""

    lock: bytes
    fence: bytes
    queue: bytes
    queue_exp: bytes
    channel: bytes
    channel_name: str
    acquire_keys: tuple[bytes, bytes, bytes, bytes, bytes]
    release_keys: tuple[bytes, bytes, bytes]
    #: The keys of REDLOCK_ACQUIRE: lock, fence, epoch.
    redlock_keys: tuple[bytes, bytes, bytes]


class KeyCache:
    """``keys_for`` per name, encoded once (bounded; hot names stay cached).

    The bound grows with the leases held (``held``, set by the driver): every held name
    is looked up once per renewal round, so a bound below that emptied the cache over and
    over and made each renewal rebuild its keys (with 50,000 leases held, three times the
    CPU per lease of 1,000)."""

    LIMIT = 4096

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.epoch = epoch_key(prefix).encode()
        self._cache: dict[str, WireKeys] = {}
        #: How many leases the driver holds now (the cache keeps twice as many names).
        self.held: Callable[[], int] = _none

    def __call__(self, name: str) -> WireKeys:
        k = self._cache.get(name)
        if k is None:
            if len(self._cache) >= self.LIMIT and len(self._cache) >= 2 * self.held():
                self._cache.clear()
            s = keys_for(name, self.prefix)
            lock, fence, q, qx = (x.encode() for x in (s.lock, s.fence, s.queue, s.queue_exp))
            k = self._cache[name] = WireKeys(
                lock,
                fence,
                q,
                qx,
                s.channel.encode(),
                s.channel,
                (lock, fence, q, qx, self.epoch),
                (lock, q, qx),
                (lock, fence, self.epoch),
            )
        return k


def _none() -> int:
    return 0


def check_prefix(prefix: object) -> str:
    """The key prefix: braces would break the ``{name}`` hash tag that keeps a lock's keys
    in one cluster slot."""
    if not isinstance(prefix, str) or "{" in prefix or "}" in prefix:
        raise ValueError(f"prefix must be a str without braces, got {prefix!r}")
    return prefix
