"""What the single-node and Redlock drivers share: key names, option checks, the pub/sub
waiting base class and the replies of the scripts both run."""

from __future__ import annotations

import inspect
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from ..._core.asyncio_only import require_asyncio
from ..._core.driver import Busy, Driver, ExtendResult, LeaseRef, Refused
from ..._core.holder import Holder
from ..._core.urls import refuse_raw_brackets, split_url
from ..._core.validation import check_seconds
from .scripts import MAX_IDLE_SUBSCRIPTIONS
from .wire import ms

logger = logging.getLogger("asynclock.redis")

_DRIVER_OPTIONS = {"socket_timeout", "connect_timeout", "prefix", "fair", "restart_grace"}


# -- keys ---------------------------------------------------------------------------------


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


def epoch_key(prefix: str = "asynclock:") -> str:
    """The database's epoch key (see ``grace_left``): no braces, so no lock name's key."""
    return f"{prefix}epoch"


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
    """``keys_for`` per name, encoded once (bounded; hot names stay cached)."""

    LIMIT = 4096

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.epoch = epoch_key(prefix).encode()
        self._cache: dict[str, WireKeys] = {}

    def __call__(self, name: str) -> WireKeys:
        k = self._cache.get(name)
        if k is None:
            if len(self._cache) >= self.LIMIT:
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


def check_prefix(prefix: object) -> str:
    """The key prefix: braces would break the ``{name}`` hash tag that keeps a lock's keys
    in one cluster slot."""
    if not isinstance(prefix, str) or "{" in prefix or "}" in prefix:
        raise ValueError(f"prefix must be a str without braces, got {prefix!r}")
    return prefix


def split_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(driver options, redis-py options) with the driver's defaults filled in."""
    ours = {k: options[k] for k in _DRIVER_OPTIONS if k in options}
    rest = {k: v for k, v in options.items() if k not in _DRIVER_OPTIONS}
    for key in ("socket_timeout", "connect_timeout"):
        ours[key] = check_seconds(ours.get(key, 1.0), key, text=True)
    ours["prefix"] = check_prefix(ours.get("prefix", "asynclock:"))
    ours["fair"] = bool(ours.get("fair", True))
    ours["restart_grace"] = check_restart_grace(ours.get("restart_grace"))
    return ours, rest


def check_restart_grace(value: object) -> float | None:
    """``restart_grace``: None (the ttl of the first acquire that finds the database's epoch
    missing) or seconds >= 0 (0: none)."""
    if value is None:
        return None
    return check_seconds(value, "restart_grace", zero=True, text=True)


def grace_ms(restart_grace: float | None, ttl_ms: int) -> bytes:
    """ARGV ``grace_ms`` of the acquire scripts."""
    if restart_grace is None:
        return b"%d" % ttl_ms
    return b"%d" % math.ceil(restart_grace * 1000)


class GraceReport:
    """Busy answers for a database in its restart grace (see ``grace_left``), and one
    WARNING per grace (per end time) for the driver's life."""

    def __init__(self, display: str) -> None:
        self.display = display
        self._warned: OrderedDict[int, None] = OrderedDict()

    def busy(self, left_ms: int, end_ms: int) -> Busy:
        until = end_ms / 1000
        if end_ms not in self._warned:
            self._warned[end_ms] = None
            if len(self._warned) > 64:  # a Redlock's nodes each have their own
                self._warned.popitem(last=False)
            logger.warning(
                "%s: restart grace until %s UTC (%.1fs from now): the database lost its lock "
                "data or never had any (a new database, a flush, or a restart without "
                "persistence), so no lock is granted before then: a lease granted before the "
                "loss may still be running. The option restart_grace (seconds; 0 turns it "
                "off) sets how long it lasts after the server starts.",
                self.display,
                time.strftime("%H:%M:%S", time.gmtime(until)),
                left_ms / 1000,
            )
        return Busy(
            left_ms / 1000,
            f"{self.display} lost its lock data or never had any (a new database, a flush, "
            "or a restart without persistence), and a lease granted before may still be "
            "running",
            grace_until=until,
        )


def pop_query_options(url: str, names: set[str]) -> tuple[str, dict[str, str]]:
    """(``url`` without the query options ``names``, their values): options of ours that
    redis-py must not see."""
    parts = urlsplit(url)
    if not parts.query:
        return url, {}
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    ours = {k: v for k, v in pairs if k in names}
    if not ours:
        return url, {}
    rest = urlencode([(k, v) for k, v in pairs if k not in names])
    return urlunsplit(parts._replace(query=rest)), ours


class SubscribingDriver(Driver):
    """Pub/sub bookkeeping shared by the Redis and Redlock drivers.

    One subscription per watched name, kept for a while after its last waiter leaves (a
    name locked again soon needs no new SUBSCRIBE). Subclasses subscribe and unsubscribe
    a channel on their node(s).
    """

    remote = True  # every acquire and release is a server round trip

    def __init__(self, prefix: str) -> None:
        super().__init__()
        require_asyncio("the Redis backend (redis://, redlock://)", "redis-py's asyncio client")
        self.keys = KeyCache(prefix)
        self._channels: dict[str, str] = {}  # channel -> name
        self._watchers: dict[str, int] = {}
        self._idle: OrderedDict[str, None] = OrderedDict()
        #: Wake-ups delivered per subscribed name (messages and resets).
        self._heard: dict[str, int] = {}
        #: The name whose last Busy answer cannot have missed a release (see ``watch``).
        self._quiet: str | None = None
        self._open = False

    async def _subscribe(self, channel: str) -> None:
        raise NotImplementedError

    async def _unsubscribe(self, channel: str) -> None:
        raise NotImplementedError

    async def watch(self, name: str, cursor: object = None) -> bool:
        # Called right after a Busy answer with no await in between, so ``_quiet`` is
        # that answer's verdict.
        quiet, self._quiet = self._quiet == name, None
        if not self._open:
            return False
        channel = self.keys(name).channel_name
        self._channels[channel] = name
        self._heard.setdefault(name, 0)
        self._watchers[name] = self._watchers.get(name, 0) + 1
        self._idle.pop(name, None)
        if quiet:
            return False
        await self._subscribe(channel)
        return True

    async def unwatch(self, name: str) -> None:
        count = self._watchers.get(name, 0) - 1
        if count > 0:
            self._watchers[name] = count
            return
        self._watchers.pop(name, None)
        self._idle[name] = None
        while len(self._idle) > MAX_IDLE_SUBSCRIPTIONS:
            old, _ = self._idle.popitem(last=False)
            channel = self.keys(old).channel_name
            self._channels.pop(channel, None)
            self._heard.pop(old, None)
            await self._unsubscribe(channel)

    def _heard_from(self, name: str) -> None:
        self._heard[name] = self._heard.get(name, 0) + 1
        self._wake(name)


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


#: What asynclock sets on every Redis connection itself (a URL or option may not).
_SET_BY_ASYNCLOCK = {
    "decode_responses": "asynclock reads raw bytes (decode_responses=False)",
}
#: Timeouts a URL query may carry (redis-py's and ours): finite seconds > 0.
_URL_TIMEOUTS = {"socket_timeout", "socket_connect_timeout", "connect_timeout", "node_timeout"}
#: redis-py timeouts a redlock:// URL may not carry, and the option that sets each.
_REDLOCK_OWN = {"socket_timeout": "node_timeout", "socket_connect_timeout": "connect_timeout"}
#: redis-py options that take a string in a URL query, besides its URL parsers' own.
_REDIS_STR_OPTIONS = {
    "client_name",
    "username",
    "password",
    "path",
    "ssl_ca_certs",
    "ssl_ca_path",
    "ssl_cert_reqs",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_password",
    "ssl_ciphers",
}


def check_redis_url(
    url: str,
    options: dict[str, Any],
    *,
    ours: set[str],
    scheme: str = "redis",
    keyword_options: set[str] = _DRIVER_OPTIONS,
) -> None:
    """Refuse a Redis URL or option that would only fail at open (or be ignored): a
    non-integer database, an unknown query option, one that asynclock sets itself. For
    ``connect()``, so a configuration error is a ValueError there, never "unavailable".

    ``ours``: the driver's own option names that its URL query may carry;
    ``keyword_options``: the driver's own keyword arguments (the rest go to redis-py)."""
    from redis.asyncio.connection import URL_QUERY_ARGUMENT_PARSERS

    refuse_raw_brackets(url, scheme, "pass password= (and username=) to asynclock.connect()")
    parts = split_url(url)  # not urlsplit: it refuses some redlock:// host lists
    if parts.scheme in ("redis", "rediss", "redlock"):
        db = unquote(parts.path).strip("/")
        if db and not db.isdigit():
            raise ValueError(
                f"the {scheme}:// URL path is the database number "
                f"({scheme}://host:6379/0), got {db!r}"
            )
    allowed = set(URL_QUERY_ARGUMENT_PARSERS) | _REDIS_STR_OPTIONS | ours
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key in _SET_BY_ASYNCLOCK:
            raise ValueError(
                f"{scheme}:// URL option {key}={value} clashes with an option asynclock "
                f"sets itself: {_SET_BY_ASYNCLOCK[key]}; remove it from the URL"
            )
        if key not in allowed:
            raise ValueError(
                f"unknown {scheme}:// URL option {key!r}; allowed: {', '.join(sorted(allowed))}"
            )
        if key == "db" and not value.isdigit():
            raise ValueError(f"{scheme}:// URL option db must be an integer, got {value!r}")
        if scheme == "redlock" and key in _REDLOCK_OWN:
            raise ValueError(f"redlock:// sets each node's {key} itself: use {_REDLOCK_OWN[key]}")
        if key in _URL_TIMEOUTS:
            try:
                check_seconds(value, key, text=True)
            except ValueError as exc:
                raise ValueError(f"{scheme}:// URL option {exc}") from None
    keywords = _redis_keywords(parts.scheme) | keyword_options
    for key in options:
        if key in _SET_BY_ASYNCLOCK:
            raise ValueError(
                f"{scheme}:// option {key}={options[key]!r} clashes with an option asynclock "
                f"sets itself: {_SET_BY_ASYNCLOCK[key]}; do not pass it"
            )
        if key not in keywords:
            raise TypeError(
                f"unknown {scheme}:// option {key!r}; allowed: "
                f"{', '.join(sorted(keywords - {'self', 'args', 'kwargs'}))}"
            )


def _redis_keywords(scheme: str) -> set[str]:
    """The keyword arguments redis-py's connection pool and connections accept."""
    from redis.asyncio import connection as rc

    cls = {"rediss": rc.SSLConnection, "unix": rc.UnixDomainSocketConnection}.get(
        scheme, rc.Connection
    )
    names = {"connection_class", "max_connections"}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None:
            names |= set(inspect.signature(init).parameters)
    return names - {"self", "args", "kwargs", *_SET_BY_ASYNCLOCK}
