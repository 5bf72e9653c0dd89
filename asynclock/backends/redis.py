"""``redis://`` — one Redis (or Valkey) server; also ``rediss://`` (TLS) and ``unix://``.

* Acquire is one round trip: a Lua script sets the lock key and bumps the name's fence
  counter, both in one hash slot (``asynclock:{name}`` and ``asynclock:{name}:fence``), so
  Redis Cluster keeps them together. A missing counter is seeded from the server's ``TIME``
  (ms * 1000) so tokens keep rising after a restart that lost data (G2).
* Waiters queue first come, first served in a sorted set next to the lock. A release hands
  the name to the oldest live waiter with a short reservation and publishes that waiter's id
  on the name's channel, so only that waiter wakes (no herd, no barging). Queue entries
  expire, so a waiter that died can delay the name by at most about one ttl, like a holder
  that died.
* The renewer's batch of leases is extended in one Lua call; each lease gets its own answer.
* One pub/sub connection per driver carries every watched name.

URL: ``redis://[[user]:password@]host[:port][/db]``, ``rediss://…`` for TLS,
``unix:///path/to/redis.sock?db=0``; query options as in redis-py (``ssl_ca_certs``, …).
Driver options (keyword arguments to :func:`asynclock.connect`): ``socket_timeout`` (per
call, seconds, default 1.0 — keep it small relative to your ttls), ``connect_timeout``
(default 1.0), ``prefix`` (key prefix, default ``"asynclock:"``), ``fair`` (FIFO waiter
queue, default True), ``restart_grace`` (seconds with no grant after the database lost its
data, default the ttl asked for; also a URL query option); anything else goes to
``redis.asyncio.ConnectionPool.from_url``.

* A restart is noticed on the pub/sub connection (kept open while a lease is held): a new
  ``run_id`` loses every lease the server granted before, and any reconnect asks the core
  for a renewal round at once. A missing epoch key (fresh or lost data) starts the restart
  grace (see ``grace_left``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import logging
import math
import secrets
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import anyio
import redis.asyncio
import redis.exceptions
from redis.asyncio.connection import AbstractConnection, ConnectionPool

from .._core.asyncio_only import require_asyncio
from .._core.driver import Busy, Driver, ExtendResult, LeaseRef, Refused
from .._core.exceptions import BackendUnavailable
from .._core.holder import Holder
from .._core.validation import check_seconds

_hiredis: Any
try:  # optional, as for redis-py: replies are parsed in C when it is there
    import hiredis as _hiredis
except ImportError:  # pragma: no cover - depends on the environment
    _hiredis = None

logger = logging.getLogger("asynclock.redis")

# -- Lua ----------------------------------------------------------------------------------
#
# Values: the lock key holds "owner:token" while held, or "~owner" while a release has
# reserved the name for the waiter ``owner`` (who then claims it with ACQUIRE). Waiters are
# members "owner:ttl_ms:probe" (or "owner:ttl_ms": no probe yet) of two sorted sets: by
# arrival (queue) and by expiry (queue_exp). ``probe`` names the waiting backend's probe
# channel, "<prefix>w:<probe>", which that backend subscribes to while it lives: PUBLISH
# there answers 0 once its connection is gone (the process died).

# Shared helpers for the scripts that take and free a lease (single node and Redlock).
_LEASE = """
-- G2: the name's next token. A missing counter (data loss) is seeded from TIME in
-- ms * 1000 before the INCR, so tokens keep rising across a restart that lost it.
-- t: a TIME reply already read, or nil.
local function next_token(fence, t)
  if redis.call('EXISTS', fence) == 0 then
    t = t or redis.call('TIME')
    local ms = math.floor(tonumber(t[2]) / 1000)
    redis.call('SET', fence, t[1] .. string.format('%03d', ms) .. '000')
  end
  return redis.call('INCR', fence)
end
-- G2 per token scope: the next token of the name's counter and of the scope's (both
-- seeded as above), whichever is larger; both counters end at it.
local function scoped_token(fence, scope, t)
  local a, b = next_token(fence, t), next_token(scope, t)
  if a < b then redis.call('SET', fence, b) elseif b < a then redis.call('SET', scope, a) end
  return math.max(a, b)
end
-- Hold the lock for owner with token for ttl ms (%d: '..' would print 1.7e+15).
local function hold(lock, owner, token, ttl)
  redis.call('SET', lock, owner .. ':' .. string.format('%d', token), 'PX', ttl)
end
-- The token of owner's lease in cur (the lock's value), or nil: an acquire retried after
-- its reply was lost gets the same answer.
local function held_token(cur, owner)
  if cur and string.sub(cur, 1, #owner + 1) == owner .. ':' then
    return tonumber(string.sub(cur, #owner + 2))
  end
  return nil
end
-- G1 across data loss: ms left of the restart grace (0: none). The epoch key lives as
-- long as the database's data; when it is missing (a fresh database, or a restart or
-- flush that lost the data) a lease granted before may still run in its holder, so none
-- is granted for grace ms from now. t: a TIME reply.
local function grace_left(epoch, grace, t)
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  grace = tonumber(grace)
  local since = tonumber(redis.call('GET', epoch) or '')
  if since == nil then
    since = now
    redis.call('SET', epoch, string.format('%d', now))
  end
  return math.min(grace, math.max(0, since + grace - now))
end
-- G5, for release: true if cur is owner's lease with token ('' = unknown: an interrupted
-- acquire, any token of ours), false if it is only owner's reservation (token ''), nil if
-- it is not ours.
local function owned(cur, owner, token)
  if token == '' then
    if held_token(cur, owner) then return true end
    if cur == '~' .. owner then return false end
    return nil
  end
  if cur == owner .. ':' .. token then return true end
  return nil
end
"""

# Shared helpers for the scripts that hand a free name to the next waiter.
_HANDOFF = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), t
end
-- (owner, ttl, probe or nil) of queue member m.
local function parse_member(m)
  local owner, ttl, probe = string.match(m, '^([^:]*):(%d+):(%x+)$')
  if owner then return owner, ttl, probe end
  owner, ttl = string.match(m, '^(.*):(%d+)$')
  return owner, ttl, nil
end
-- Forget waiters that stopped asking (their entry expired) or died (nobody listens on
-- their probe channel: the waiter's connection closed); return the oldest live one.
-- lock: the lock key, whose text up to '{' is the key prefix.
local function head(q, qx, now, lock)
  if redis.call('EXISTS', q) == 0 then return nil end
  local dead = redis.call('ZRANGEBYSCORE', qx, '-inf', now, 'LIMIT', 0, 100)
  for _, m in ipairs(dead) do
    redis.call('ZREM', q, m)
    redis.call('ZREM', qx, m)
  end
  local pre = string.match(lock, '^[^{]*') .. 'w:'
  for _ = 1, 100 do
    local m = redis.call('ZRANGE', q, 0, 0)[1]
    if m == nil then return nil end
    local _, _, probe = parse_member(m)
    if probe == nil or redis.call('PUBLISH', pre .. probe, '') > 0 then return m end
    redis.call('ZREM', q, m)
    redis.call('ZREM', qx, m)
  end
  return redis.call('ZRANGE', q, 0, 0)[1]
end
-- Reserve the free name for waiter member m (for its own ttl) and wake only it.
-- With no waiter, publish '' so any watcher may try. Returns the reservation in ms or nil.
local function handoff(lock, q, qx, chan, m)
  if m then
    redis.call('ZREM', q, m)
    redis.call('ZREM', qx, m)
    local owner, ttl = parse_member(m)
    redis.call('SET', lock, '~' .. owner, 'PX', ttl)
    redis.call('PUBLISH', chan, owner)
    return tonumber(ttl)
  end
  redis.call('PUBLISH', chan, '')
  return nil
end
"""

# ACQUIRE (G1 exclusion, G2 monotonic tokens, fair queue).
# KEYS: lock, fence, queue, queue_exp, epoch[, scope fence: token_scope's counter, next_token's
# twin]. ARGV: owner, ttl_ms, mode, channel, grace_ms,
# probe; mode 0 = no queue (fair=False), 1 = respect the queue, 2 = respect it and wait in
# it; grace_ms: the restart grace (see grace_left); probe: this backend's probe id, or ''
# (not subscribed yet: a waiter that joined without one gets it added, keeping its place).
# Returns {token} when granted, {0, retry_after_ms} when busy (or in the restart grace),
# {0, -1} when the lock key has no expiry (not ours: another tool's or a legacy key).
# The fence counter is never deleted (see next_token).
ACQUIRE = (
    _LEASE
    + _HANDOFF
    + """
local lock, fence, q, qx, epoch = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local owner, ttl, mode, chan = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local member = owner .. ':' .. ttl
local cur = redis.call('GET', lock)
local now, t = now_ms()
if mode == '2' and ARGV[6] ~= '' then
  local plain = member
  member = member .. ':' .. ARGV[6]
  local score = redis.call('ZSCORE', q, plain)
  if score then  -- queued before our probe was subscribed: add it, keep the place
    local until_ms = redis.call('ZSCORE', qx, plain) or (now + 1000)
    redis.call('ZREM', q, plain)
    redis.call('ZREM', qx, plain)
    redis.call('ZADD', q, score, member)
    redis.call('ZADD', qx, until_ms, member)
  end
end
local function grant()
  local token
  if KEYS[6] then token = scoped_token(fence, KEYS[6], t) else token = next_token(fence, t) end
  hold(lock, owner, token, ttl)
  if mode == '2' and redis.call('EXISTS', q) == 1 then
    redis.call('ZREM', q, member)
    redis.call('ZREM', qx, member)
  end
  return {token}
end
if cur == '~' .. owner then return grant() end
local mine = held_token(cur, owner)
if mine then return {mine} end
local left
if cur == false then
  left = grace_left(epoch, ARGV[5], t)
end
if left and left > 0 then
  -- In the restart grace: wait (and queue) as if the name were held.
elseif cur == false then
  if mode == '0' then return grant() end
  local first = head(q, qx, now, lock)
  if first == nil or first == member then return grant() end
  left = handoff(lock, q, qx, chan, first)
else
  left = redis.call('PTTL', lock)
end
local no_expiry = left == -1
if left == nil or left < 0 then left = 0 end
if mode == '2' then
  redis.call('ZADD', q, 'NX', t[1] .. string.format('%06d', tonumber(t[2])), member)
  local life = left + math.floor(left / 5) + 200
  redis.call('ZADD', qx, now + life, member)
  if redis.call('PTTL', q) < life then
    redis.call('PEXPIRE', q, life)
    redis.call('PEXPIRE', qx, life)
  end
end
if no_expiry then return {0, -1} end
return {0, left}
"""
)

# EXTEND (G5 owner-checked, G7 same token): renew every lease of a batch in one call.
# KEYS: lock keys. ARGV: for lease i, ARGV[2i-1] = "owner:token", ARGV[2i] = ttl_ms.
# Returns one entry per lease: 1 extended, 0 key gone, -1 held by someone else.
# Never re-creates a missing key: a lease that expired stays lost.
EXTEND = """
local out = {}
for i = 1, #KEYS do
  local cur = redis.call('GET', KEYS[i])
  if cur == ARGV[2 * i - 1] then
    redis.call('PEXPIRE', KEYS[i], ARGV[2 * i])
    out[i] = 1
  elseif cur == false then
    out[i] = 0
  else
    out[i] = -1
  end
end
return out
"""

# RELEASE (G5): delete the lock only if it is ours, then hand the name to the next waiter.
# KEYS: lock, queue, queue_exp. ARGV: owner, token ('' = unknown: an interrupted acquire,
# match any token of ours or our reservation), channel.
# Returns 1 if our lease was removed, 0 if it was not ours (or only a reservation).
RELEASE = (
    _LEASE
    + _HANDOFF
    + """
local lock, q, qx = KEYS[1], KEYS[2], KEYS[3]
local owner, token, chan = ARGV[1], ARGV[2], ARGV[3]
local cur = redis.call('GET', lock)
if cur == false then return 0 end
local held = owned(cur, owner, token)
if held == nil then return 0 end
redis.call('DEL', lock)
if redis.call('EXISTS', q) == 1 then
  handoff(lock, q, qx, chan, head(q, qx, (now_ms()), lock))
else
  redis.call('PUBLISH', chan, '')
end
if held then return 1 end
return 0
"""
)

# ABANDON: a queued waiter gave up. KEYS: lock, queue, queue_exp.
# ARGV: member ("owner:ttl_ms", with or without ":probe": both are removed), owner, channel.
# If the name was reserved for this waiter, pass the reservation on to the next one.
# Returns 1.
ABANDON = (
    _HANDOFF
    + """
local lock, q, qx = KEYS[1], KEYS[2], KEYS[3]
local plain = string.match(ARGV[1], '^([^:]*:%d+)') or ARGV[1]
for _, m in ipairs({ARGV[1], plain}) do
  redis.call('ZREM', q, m)
  redis.call('ZREM', qx, m)
end
if redis.call('GET', lock) == '~' .. ARGV[2] then
  redis.call('DEL', lock)
  handoff(lock, q, qx, ARGV[3], head(q, qx, (now_ms()), lock))
end
return 1
"""
)

# REDLOCK_ACQUIRE (Redlock phase 1; G1 exclusion, G2 monotonic tokens): ACQUIRE in mode 0
# (no waiter queue: Redlock never queues) with nothing that mode does not need, so each
# node spends less time per call (every node's time is on the path of every acquisition).
# KEYS: lock, fence, epoch[, scope fence]. ARGV: owner, ttl_ms, grace_ms (the restart grace,
# per node).
# Returns {token} when granted, {0, retry_after_ms} when busy, {0, -1} when the lock key has
# no expiry (as ACQUIRE). The counter is seeded from TIME exactly as in ACQUIRE (next_token).
REDLOCK_ACQUIRE = (
    _LEASE
    + """
local lock, fence, owner = KEYS[1], KEYS[2], ARGV[1]
local cur = redis.call('GET', lock)
if cur and cur ~= '~' .. owner then
  local mine = held_token(cur, owner)
  if mine then return {mine} end
  local left = redis.call('PTTL', lock)
  if left == -1 then return {0, -1} end
  if left < 0 then left = 0 end
  return {0, left}
end
local t = redis.call('TIME')
local left = grace_left(KEYS[3], ARGV[3], t)
if left > 0 then return {0, left} end
local token
if KEYS[4] then token = scoped_token(fence, KEYS[4], t) else token = next_token(fence, t) end
hold(lock, owner, token, ARGV[2])
return {token}
"""
)

# REDLOCK_RELEASE (G5): RELEASE without the waiter queue (Redlock never queues): delete the
# lock only if it is ours, then wake the name's watchers with "-owner" (so the releasing
# backend can tell its own give-back of a failed attempt from another's release).
# KEYS: lock. ARGV: owner, token ('' = unknown: an interrupted acquire, match any token of
# ours or our reservation), channel.
# Returns 1 if our lease was removed, 0 if it was not ours (or only a reservation).
REDLOCK_RELEASE = (
    _LEASE
    + """
local cur = redis.call('GET', KEYS[1])
if cur == false then return 0 end
local held = owned(cur, ARGV[1], ARGV[2])
if held == nil then return 0 end
redis.call('DEL', KEYS[1])
redis.call('PUBLISH', ARGV[3], '-' .. ARGV[1])
if held then return 1 end
return 0
"""
)

# RAISE_FENCE (Redlock phase 2, G2): where this node still holds our key, raise the fence
# counter to the agreed token t (never lower it) and record t in the lock value.
# KEYS: lock, fence[, scope fence] (a token scope's counter is raised alike).
# ARGV: owner, t. Returns 1 if done, 0 if the key is no longer ours.
RAISE_FENCE = """
local cur = redis.call('GET', KEYS[1])
local owner = ARGV[1]
if not cur or string.sub(cur, 1, #owner + 1) ~= owner .. ':' then return 0 end
for i = 2, #KEYS do
  local f = tonumber(redis.call('GET', KEYS[i]) or '0')
  if f < tonumber(ARGV[2]) then redis.call('SET', KEYS[i], ARGV[2]) end
end
redis.call('SET', KEYS[1], owner .. ':' .. ARGV[2], 'KEEPTTL')
return 1
"""

# HOLDER: who holds the lock, in one round trip. KEYS: lock. Returns {"owner:token",
# pttl_ms} while a lease holds it, {} when it is free or only reserved for a waiter.
HOLDER = """
local cur = redis.call('GET', KEYS[1])
if not cur or string.sub(cur, 1, 1) == '~' then return {} end
return {cur, redis.call('PTTL', KEYS[1])}
"""

# BREAK (operators; G2 kept: the fence counter is untouched, so the next token is larger):
# delete whoever's lease holds the lock, then hand the name to the next waiter as RELEASE
# does. The broken owner's next EXTEND finds the key gone (refused). KEYS: lock, queue,
# queue_exp. ARGV: channel. Returns 1 if a lease was deleted, 0 if none held the lock (a
# waiter's reservation is left alone).
BREAK = (
    _HANDOFF
    + """
local lock, q, qx, chan = KEYS[1], KEYS[2], KEYS[3], ARGV[1]
local cur = redis.call('GET', lock)
if not cur or string.sub(cur, 1, 1) == '~' then return 0 end
redis.call('DEL', lock)
if redis.call('EXISTS', q) == 1 then
  handoff(lock, q, qx, chan, head(q, qx, (now_ms()), lock))
else
  redis.call('PUBLISH', chan, '')
end
return 1
"""
)

SCRIPTS = {
    "acquire": ACQUIRE,
    "extend": EXTEND,
    "release": RELEASE,
    "abandon": ABANDON,
    "raise_fence": RAISE_FENCE,
    "redlock_acquire": REDLOCK_ACQUIRE,
    "redlock_release": REDLOCK_RELEASE,
    "holder": HOLDER,
    "break": BREAK,
}
#: EVALSHA digests (the same on every server: SHA1 of the script text).
SHAS = {key: hashlib.sha1(text.encode()).hexdigest().encode() for key, text in SCRIPTS.items()}

# Modes of ACQUIRE.
NO_QUEUE, RESPECT_QUEUE, JOIN_QUEUE = b"0", b"1", b"2"

#: The answer for a lock key without an expiry (PTTL -1): asynclock's keys always have one.
NO_EXPIRY = Busy(
    None,
    "its Redis key has no expiry (PTTL -1: set by another tool, or a legacy lock), so when "
    "it frees is unknown; waiters poll for it",
)

#: Idle pub/sub subscriptions kept open (so a name locked again soon costs no SUBSCRIBE).
MAX_IDLE_SUBSCRIPTIONS = 256

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


def ms(seconds: float) -> int:
    """Seconds to whole milliseconds, rounded up (a server ttl never shorter than asked)."""
    return max(1, math.ceil(seconds * 1000))


# -- one server -----------------------------------------------------------------------------


def display_url(url: str) -> str:
    """``url`` without its password (and without the query string)."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return f"unix://{parts.path}"
    host = parts.hostname or "localhost"
    if ":" in host:
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port else ""
    user = f"{unquote(parts.username)}@" if parts.username else ""
    path = parts.path if parts.path not in ("", "/") else "/0"
    return f"{parts.scheme}://{user}{host}{port}{path}"


def pack(*args: bytes) -> bytes:
    """One command in the Redis protocol (RESP). Every command the drivers send on their
    command connections goes through here (benchmarks count commands at this point)."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        out.append(b"$%d\r\n%b\r\n" % (len(arg), arg))
    return b"".join(out)


#: Idle command connections a node keeps open (more are opened while calls overlap).
MAX_IDLE_CONNECTIONS = 256


def _no_client_info() -> dict[str, Any]:
    """Connection keywords that turn redis-py's ``CLIENT SETINFO`` off: ``driver_info=None``
    (redis-py >= 7), else ``lib_name=None, lib_version=None`` (redis-py 5 and 6)."""
    params = inspect.signature(AbstractConnection.__init__).parameters
    if "driver_info" in params:
        return {"driver_info": None}
    if "lib_name" in params:
        return {"lib_name": None, "lib_version": None}
    return {}  # pragma: no cover - older than redis-py 5: it sends no CLIENT SETINFO


_NO_CLIENT_INFO = _no_client_info()


class Deadlines:
    """Deadlines for many short calls, kept by one timer.

    ``with deadlines.at(when):`` behaves like ``asyncio.timeout_at(when)``: at ``when`` the
    task is cancelled, and the block raises ``TimeoutError`` (a cancellation from anyone
    else propagates unchanged, counted as asyncio counts it). ``asyncio.timeout_at``
    schedules and cancels a timer per call, which at thousands of calls a second costs
    more than the rest of a call's Python; here one timer waits for the earliest deadline
    of the calls in progress and is moved only when a call with an earlier deadline
    starts (the calls of one driver mostly share one timeout, so rarely).
    """

    __slots__ = ("_armed", "_calls", "_handle", "_loop")

    def __init__(self) -> None:
        self._calls: set[Deadline] = set()
        self._handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._armed = math.inf  # when the timer fires (inf: no timer)

    def at(self, when: float) -> Deadline:
        return Deadline(self, when)

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._loop = loop
        self._armed = when
        self._handle = loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self._handle = None
        self._armed = math.inf
        loop = self._loop
        assert loop is not None
        now = loop.time()
        later = math.inf
        for call in self._calls:
            if call.when <= now:
                if not call.fired:
                    call.fired = True
                    call.task.cancel()
            elif call.when < later:
                later = call.when
        if later < math.inf:
            self._arm(loop, later)


class Deadline:
    """One call's deadline (see :class:`Deadlines`); a sync context manager."""

    __slots__ = ("cancelling", "fired", "owner", "task", "when")

    def __init__(self, owner: Deadlines, when: float) -> None:
        self.owner = owner
        self.when = when
        self.fired = False

    def __enter__(self) -> Deadline:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        assert task is not None
        self.task = task
        self.cancelling = task.cancelling()
        owner = self.owner
        if owner._loop is not loop:  # a new event loop: the old timer is gone with it
            owner._calls.clear()
            owner._handle = None
            owner._armed = math.inf
        owner._calls.add(self)
        if self.when < owner._armed:
            owner._arm(loop, self.when)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: object,
    ) -> None:
        self.owner._calls.discard(self)
        if (
            self.fired
            and self.task.uncancel() <= self.cancelling
            and exc_type is not None
            and issubclass(exc_type, asyncio.CancelledError)
        ):
            raise TimeoutError from exc


def _reply_error(message: str) -> redis.exceptions.ResponseError:
    """An error reply as the exception redis-py raises for it (NOSCRIPT matters: the
    script is loaded again)."""
    if message.startswith("NOSCRIPT"):
        return redis.exceptions.NoScriptError(message)
    return redis.exceptions.ResponseError(message)


class Wire:
    """A command connection (redis-py's: connect, AUTH/ACL, TLS, ``SELECT``) and the way
    its replies are read.

    The lean path writes to the connection's ``asyncio.StreamWriter`` and parses replies
    from its ``asyncio.StreamReader`` with a ``hiredis.Reader`` of its own (redis-py's
    private ``_writer`` and ``_reader``, present since redis-py 4.2; redis-py's parser is
    never touched). Each command is read to the end of its reply, and a RESP2 server sends
    nothing unasked on a command connection, so no bytes are ever left in either parser.
    Without hiredis, without the streams, or on RESP3 (push messages), the public
    ``send_packed_command`` and ``read_response`` are used.
    """

    __slots__ = ("conn", "parser", "stream", "writer")

    def __init__(self, conn: AbstractConnection) -> None:
        self.conn = conn
        writer = getattr(conn, "_writer", None)
        stream = getattr(conn, "_reader", None)
        self.writer = writer if isinstance(writer, asyncio.StreamWriter) else None
        self.stream: asyncio.StreamReader | None = None
        self.parser: Any = None
        if (
            _hiredis is not None
            and self.writer is not None
            and isinstance(stream, asyncio.StreamReader)
            and getattr(conn, "protocol", None) == 2
        ):
            self.stream = stream
            self.parser = _hiredis.Reader(replyError=_reply_error)

    async def read(self) -> Any:
        """The next reply; an error reply raises (redis-py's exceptions either way)."""
        parser, stream = self.parser, self.stream
        if parser is None or stream is None:
            return await self.conn.read_response()
        reply = parser.gets()
        while reply is False:
            try:
                data = await stream.read(65536)
            except OSError as exc:
                raise redis.exceptions.ConnectionError(f"error reading a reply: {exc!r}") from exc
            if not data:
                raise redis.exceptions.ConnectionError("the server closed the connection")
            parser.feed(data)
            reply = parser.gets()
        if isinstance(reply, redis.exceptions.ResponseError):
            raise reply
        return reply


def _resp2(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Connection keywords for RESP2. Maintenance notifications need RESP3 or hiredis, and
    a RESP2 connection may use the pure-Python parser, so they are turned off (redis-py
    >= 7 passes them)."""
    out = {**kwargs, "protocol": 2}
    for key in ("maint_notifications_config", "maint_notifications_pool_handler"):
        if key in out:
            out[key] = None
    return out


class Node:
    """One Redis server: command connections, scripts, error translation.

    Commands go out on dedicated redis-py connections that this node hands out one call at
    a time (no pool lock, no per-call task): ``send`` writes a packed command, ``receive``
    reads its reply under a deadline. A connection whose call did not end with a complete
    reply (timeout, cancellation, I/O error) is closed, never reused.
    """

    def __init__(
        self,
        url: str,
        *,
        socket_timeout: float,
        connect_timeout: float,
        options: dict[str, Any],
    ) -> None:
        self.url = url
        self.display = display_url(url)
        self.socket_timeout = socket_timeout
        self.connect_timeout = connect_timeout
        self._secret = unquote(urlsplit(url).password or "") or str(options.get("password") or "")
        try:
            self.pool: ConnectionPool = ConnectionPool.from_url(
                url,
                socket_timeout=socket_timeout,
                socket_connect_timeout=connect_timeout,
                decode_responses=False,
                **options,
            )
        except (ValueError, TypeError) as exc:
            raise ValueError(f"bad Redis URL {self.display!r}: {self.scrub(str(exc))}") from None
        # Our calls bound themselves (connect, send and read under one deadline).
        self._kwargs = {**self.pool.connection_kwargs, "socket_timeout": None}
        if not {"driver_info", "lib_name", "lib_version"} & set(self._kwargs):
            # No CLIENT SETINFO (two commands on every new connection) unless asked for.
            self._kwargs.update(_NO_CLIENT_INFO)
        if "protocol" not in self._kwargs:
            # RESP2 unless asked for RESP3: the lean path parses the replies itself (see
            # Wire), and a private connection has no use for redis-py's maintenance
            # notifications (RESP3 push messages; also no HELLO on connect).
            self._kwargs = _resp2(self._kwargs)
        self._idle: list[Wire] = []
        self._closed = False
        self.deadlines = Deadlines()
        #: The server's ``run_id`` when last seen (None: not yet, or INFO is denied).
        self.run_id: str | None = None

    def scrub(self, text: str) -> str:
        return text.replace(self._secret, "***") if self._secret else text

    def error(self, what: str, exc: BaseException) -> BackendUnavailable:
        """A driver error as BackendUnavailable, with no password in the message."""
        if isinstance(exc, BackendUnavailable):
            return exc
        text = str(exc)
        if isinstance(exc, redis.exceptions.NoPermissionError) or (
            "NOPERM" in text or "can't run this command" in text or "ACL failure" in text
        ):
            why = (
                f"permission denied ({text}): the ACL user lacks a command, key or channel "
                "asynclock needs; see the ACL rules in the Redis backend docs"
            )
        elif isinstance(exc, redis.exceptions.AuthenticationError):
            why = "authentication failed: check the user name and password in the URL"
        elif isinstance(exc, redis.exceptions.TimeoutError | TimeoutError):
            why = f"timed out after {self.socket_timeout:g}s (socket_timeout)"
        elif "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
            why = "authentication failed: check the user name and password in the URL"
        else:
            why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return BackendUnavailable(f"{self.display}: {what} failed: {self.scrub(why)}")

    def reason(self, exc: BaseException) -> str:
        """A short, password-free reason for one node's failure."""
        msg = str(exc)
        prefix = f"{self.display}: "
        return msg[len(prefix) :] if msg.startswith(prefix) else self.scrub(msg or repr(exc))

    # -- the command path ----------------------------------------------------------------

    async def _connect(self) -> Wire:
        conn: AbstractConnection = self.pool.connection_class(**self._kwargs)
        await conn.connect()  # type: ignore[no-untyped-call]
        return Wire(conn)

    def send(self, packed: bytes) -> Wire | None:
        """Write ``packed`` on an idle connection; None if there is none.

        Never waits, so callers can start one command on many nodes in a row. The bytes
        go to the connection's transport, which sends at once or buffers; a connection
        that died meanwhile shows up as a ConnectionError when its reply is read.
        """
        if not self._idle:
            return None
        writer = self._idle[-1].writer
        if writer is None:
            return None  # ``receive`` sends through redis-py's public path instead
        writer.write(packed)
        return self._idle.pop()

    def keep(self, wire: Wire) -> bool:
        """Put a connection whose reply was read in full back for reuse (False: full)."""
        if self._closed or len(self._idle) >= MAX_IDLE_CONNECTIONS:
            return False
        self._idle.append(wire)
        return True

    async def receive(self, wire: Wire | None, packed: bytes, deadline: float | None) -> Any:
        """The reply to ``packed`` sent on ``wire`` (None: not sent yet), by ``deadline``
        (event-loop time; None: the caller bounds the wait). A reused connection that
        turns out dead (the server restarted) is replaced once; every script is safe to
        run twice."""
        if deadline is None:
            return await self._receive(wire, packed)
        with self.deadlines.at(deadline):
            return await self._receive(wire, packed)

    async def _receive(self, wire: Wire | None, packed: bytes) -> Any:
        if wire is not None:
            try:
                return await self._read(wire)
            except redis.exceptions.ConnectionError:
                pass
        elif self._idle:  # not sent yet (see ``send``): the public path
            wire = self._idle.pop()
            try:
                await wire.conn.send_packed_command(packed, check_health=False)
                return await self._read(wire)
            except redis.exceptions.ConnectionError:
                await drop_connection(wire.conn)
        wire = await self._connect()
        try:
            await wire.conn.send_packed_command(packed, check_health=False)
        except BaseException:
            await drop_connection(wire.conn)
            raise
        return await self._read(wire)

    async def _read(self, wire: Wire) -> Any:
        try:
            reply = await wire.read()
        except redis.exceptions.ResponseError:
            await self._keep(wire)  # a complete (error) reply: the connection is fine
            raise
        except BaseException:
            await drop_connection(wire.conn)
            raise
        await self._keep(wire)
        return reply

    async def _keep(self, wire: Wire) -> None:
        if not self.keep(wire):
            await drop_connection(wire.conn)

    async def call(self, packed: bytes, deadline: float) -> Any:
        """Send ``packed`` and return its reply (raw driver exceptions)."""
        return await self.receive(self.send(packed), packed, deadline)

    def deadline(self, timeout: float | None = None) -> float:
        return asyncio.get_running_loop().time() + (
            self.socket_timeout if timeout is None else timeout
        )

    # -- scripts -------------------------------------------------------------------------

    async def load(self, timeout: float | None = None) -> None:
        """Load every script (also checks that the server is reachable and lets us in),
        and read the server's ``run_id``."""
        deadline = self.deadline(timeout)
        try:
            for text in SCRIPTS.values():
                await self.call(pack(b"SCRIPT", b"LOAD", text.encode()), deadline)
            self.run_id = await self.read_run_id(deadline)
        except Exception as exc:
            raise self.error("connect", exc) from exc

    async def read_run_id(self, deadline: float) -> str | None:
        """The server's ``run_id`` (new on every start), or None if ``INFO`` is denied."""
        try:
            info = await self.call(pack(b"INFO", b"server"), deadline)
        except redis.exceptions.ResponseError as exc:
            logger.debug("INFO on %s refused: %r", self.display, exc)
            return None
        return parse_run_id(info)

    async def run(
        self,
        script: str,
        keys: Sequence[bytes],
        args: Sequence[bytes],
        timeout: float | None = None,
    ) -> Any:
        """EVALSHA ``script``; load it again on NOSCRIPT (after a restart or SCRIPT FLUSH)."""
        deadline = self.deadline(timeout)
        packed = pack_script(script, keys, args)
        try:
            try:
                return await self.call(packed, deadline)
            except redis.exceptions.NoScriptError:
                await self.call(pack(b"SCRIPT", b"LOAD", SCRIPTS[script].encode()), deadline)
                return await self.call(packed, deadline)
        except Exception as exc:
            raise self.error(script, exc) from exc

    async def get(self, key: bytes) -> bytes | None:
        try:
            value = await self.call(pack(b"GET", key), self.deadline())
        except Exception as exc:
            raise self.error("get", exc) from exc
        return value if isinstance(value, bytes) or value is None else str(value).encode()

    def make_connection(self) -> AbstractConnection:
        """A dedicated connection (for pub/sub) that waits for messages without a timeout."""
        # RESP2: messages come back as plain replies (RESP3 routes them to a push handler).
        conn: AbstractConnection = self.pool.connection_class(**_resp2(self._kwargs))
        return conn

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for wire in idle:
            await drop_connection(wire.conn)
        try:
            await self.pool.disconnect()
        except Exception as exc:  # pragma: no cover - best effort
            logger.debug("closing %s: %r", self.display, exc)


async def drop_connection(conn: AbstractConnection) -> None:
    """Close a connection whose state is unknown (does not wait: safe while cancelled)."""
    with contextlib.suppress(Exception):
        await conn.disconnect(nowait=True)


def parse_run_id(info: object) -> str | None:
    """``run_id`` from an ``INFO server`` reply."""
    text = info.decode(errors="replace") if isinstance(info, bytes) else str(info)
    for line in text.splitlines():
        if line.startswith("run_id:"):
            return line[len("run_id:") :].strip() or None
    return None


def pack_script(script: str, keys: Sequence[bytes], args: Sequence[bytes]) -> bytes:
    return pack(b"EVALSHA", SHAS[script], b"%d" % len(keys), *keys, *args)


class Listener:
    """One pub/sub connection to a node, carrying every channel its driver watches.

    ``on_message(channel, payload)`` runs for each message; ``on_reset()`` after the
    connection drops (messages may have been missed); ``on_connect(run_id, reconnected)``
    after each connect, with the server's ``run_id`` (None if ``INFO`` is denied).
    :meth:`run` is the reader; the driver runs it from :meth:`Driver.background`. It
    connects on the first subscription or :meth:`keep_connected`, and reconnects with
    backoff: while a lease is held, this connection is how a server restart is noticed
    (the socket closes at once), not the next renewal.
    """

    #: Longest pause between reconnect attempts.
    MAX_BACKOFF = 0.25

    def __init__(
        self,
        node: Node,
        on_message: Callable[[str, bytes], None],
        on_reset: Callable[[], None],
        on_connect: Callable[[str | None, bool], None] | None = None,
    ) -> None:
        self.node = node
        self.on_message = on_message
        self.on_reset = on_reset
        self.on_connect = on_connect
        self.wanted: set[str] = set()
        self.confirmed: set[str] = set()
        #: Bumped on every (re)connect: a subscription confirmed in an older epoch is void.
        self.epoch = 0
        self._conn: AbstractConnection | None = None
        self._confirm_events: dict[str, anyio.Event] = {}
        self._write = anyio.Lock()
        self._needed = anyio.Event()

    def keep_connected(self) -> None:
        """Connect now (if not yet) and stay connected: a lease is held on this node."""
        self._needed.set()

    async def subscribe(self, channel: str, wait: float) -> None:
        """Subscribe; wait up to ``wait`` seconds for the server to confirm. Never raises."""
        self.wanted.add(channel)
        if channel in self.confirmed:
            return
        self._needed.set()
        event = self._confirm_events.setdefault(channel, anyio.Event())
        await self._send("SUBSCRIBE", channel)
        with anyio.move_on_after(wait):
            await event.wait()

    async def unsubscribe(self, channel: str) -> None:
        self.wanted.discard(channel)
        self.confirmed.discard(channel)
        await self._send("UNSUBSCRIBE", channel)

    async def _send(self, *args: str) -> None:
        conn = self._conn
        if conn is None:
            return  # the reader subscribes to everything wanted when it connects
        try:
            async with self._write:
                await conn.send_command(*args, check_health=False)
        except Exception as exc:
            logger.debug("pub/sub %s on %s failed: %r", args[0], self.node.display, exc)

    async def run(self) -> None:
        """Read messages until cancelled (the backend closing)."""
        await self._needed.wait()
        backoff = 0.02
        connected = False
        while True:
            conn = self.node.make_connection()
            try:
                await conn.connect()  # type: ignore[no-untyped-call]
                run_id = await self._run_id(conn) if self.on_connect is not None else None
                self._conn = conn
                if self.wanted:
                    async with self._write:
                        await conn.send_command("SUBSCRIBE", *self.wanted, check_health=False)
                backoff = 0.02
                if self.on_connect is not None:
                    self.on_connect(run_id, connected)
                connected = True
                while True:
                    reply = await conn.read_response(timeout=math.inf)
                    self._handle(reply)
            except Exception as exc:
                logger.debug("pub/sub connection to %s dropped: %r", self.node.display, exc)
            finally:
                self._conn = None
                self.confirmed.clear()
                self.epoch += 1
                await drop_connection(conn)
            self.on_reset()
            await anyio.sleep(backoff)
            backoff = min(backoff * 2, self.MAX_BACKOFF)

    async def _run_id(self, conn: AbstractConnection) -> str | None:
        """The server's ``run_id``, read before subscribing (None if INFO is denied)."""
        await conn.send_command("INFO", "server", check_health=False)
        try:
            reply = await conn.read_response(timeout=self.node.connect_timeout)
        except redis.exceptions.ResponseError:
            return None
        return parse_run_id(reply)

    def _handle(self, reply: Any) -> None:
        if not isinstance(reply, list) or len(reply) < 3:
            return
        kind = reply[0]
        channel = reply[1].decode() if isinstance(reply[1], bytes) else str(reply[1])
        if kind == b"message":
            self.on_message(channel, reply[2] if isinstance(reply[2], bytes) else b"")
        elif kind == b"subscribe":
            if channel in self.wanted:
                self.confirmed.add(channel)
            event = self._confirm_events.pop(channel, None)
            if event is not None:
                event.set()


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
        ours[key] = check_seconds(ours.get(key, 1.0), key)
    ours["prefix"] = check_prefix(ours.get("prefix", "asynclock:"))
    ours["fair"] = bool(ours.get("fair", True))
    ours["restart_grace"] = check_restart_grace(ours.get("restart_grace"))
    return ours, rest


def check_restart_grace(value: object) -> float | None:
    """``restart_grace``: None (the ttl being asked for) or seconds >= 0 (0: none)."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"restart_grace must be a number of seconds, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"restart_grace must be a number of seconds, not {type(value).__name__}")
    if not 0 <= value < math.inf:
        raise ValueError(
            f"restart_grace must be a finite number of seconds >= 0 (0 turns it off), got {value!r}"
        )
    return float(value)


def grace_ms(restart_grace: float | None, ttl_ms: int) -> bytes:
    """ARGV ``grace_ms`` of the acquire scripts."""
    if restart_grace is None:
        return b"%d" % ttl_ms
    return b"%d" % math.ceil(restart_grace * 1000)


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


# -- the driver -----------------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class _Wait:
    """A local waiter of the fair queue, and the last answer the server gave it."""

    member: str
    #: Bumped when a message may concern this waiter (it was handed the name, or a broadcast).
    bumps: int = 0
    joined: bool = False
    #: A Busy answer stays true until this clock time, unless ``bumps`` moves.
    valid_until: float = -math.inf
    valid_bumps: int = -1


class SubscribingDriver(Driver):
    """Pub/sub bookkeeping shared by the Redis and Redlock drivers.

    One subscription per watched name, kept for a while after its last waiter leaves (a
    name locked again soon needs no new SUBSCRIBE). Subclasses subscribe and unsubscribe
    a channel on their node(s).
    """

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

    async def watch(self, name: str) -> bool:
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


class RedisDriver(SubscribingDriver):
    """Locks on one Redis server (see the module docstring)."""

    def __init__(
        self,
        url: str,
        *,
        socket_timeout: float = 1.0,
        connect_timeout: float = 1.0,
        prefix: str = "asynclock:",
        fair: bool = True,
        restart_grace: float | None = None,
        **redis_options: Any,
    ) -> None:
        super().__init__(prefix)
        self.restart_grace = check_restart_grace(restart_grace)
        self.node = Node(
            url,
            socket_timeout=socket_timeout,
            connect_timeout=connect_timeout,
            options=redis_options,
        )
        self.display = self.node.display
        self.prefix = prefix
        self.fair = fair
        self.listener = Listener(self.node, self._on_message, self._on_reset, self._on_connect)
        self._waits: dict[str, dict[str, _Wait]] = {}
        #: Leases granted here and not yet released: owner -> (name, drops seen at grant).
        self._leases: dict[str, tuple[str, int]] = {}
        self._drops = 0
        #: This backend's probe channel (see the Lua notes): a queue entry naming it is
        #: skipped at once when this backend's connection is gone.
        self._probe = secrets.token_hex(8)
        self._probe_channel = f"{prefix}w:{self._probe}"

    # -- lifecycle -------------------------------------------------------------------------

    async def open(self) -> None:
        require_asyncio(self.display, "redis-py's asyncio client")
        await self.node.load()
        self._open = True

    async def background(self) -> None:
        await self.listener.run()

    async def aclose(self) -> None:
        self._open = False
        await self.node.aclose()

    # -- primitives ------------------------------------------------------------------------

    async def acquire(
        self, name: str, owner: str, ttl: float, *, queue: bool, scope: str | None = None
    ) -> int | Busy:
        k = self.keys(name)
        ttl_ms = ms(ttl)
        mode = (JOIN_QUEUE if queue else RESPECT_QUEUE) if self.fair else NO_QUEUE
        wait: _Wait | None = None
        if mode == JOIN_QUEUE:
            waits = self._waits.setdefault(name, {})
            wait = waits.get(owner)
            now = self.clock.now()
            if wait is None:
                wait = waits[owner] = _Wait(f"{owner}:{ttl_ms}")
            if self._probe_channel in self.listener.confirmed:
                wait.member = f"{owner}:{ttl_ms}:{self._probe}"
            if wait.valid_bumps == wait.bumps and now < wait.valid_until:
                # Nothing that concerns us was published since the server said "busy"
                # (and we were subscribed before asking): that answer still holds.
                self._quiet = name
                return Busy(wait.valid_until - now)
        listener = self.listener
        trusted = k.channel_name in listener.confirmed
        epoch = listener.epoch
        heard = self._heard.get(name, 0)
        bumps = wait.bumps if wait is not None else 0
        t_send = self.clock.now()
        probe = self._probe.encode() if wait is not None and wait.member.count(":") == 2 else b""
        keys: tuple[bytes, ...] = k.acquire_keys
        if scope is not None:
            keys = (*keys, scope_fence_key(scope, self.keys.prefix))
        reply = await self.node.run(
            "acquire",
            keys,
            (
                owner.encode(),
                b"%d" % ttl_ms,
                mode,
                k.channel,
                grace_ms(self.restart_grace, ttl_ms),
                probe,
            ),
        )
        if reply[0]:
            if wait is not None:
                self._forget_wait(name, owner)
            self._leases[owner] = (name, self._drops)
            if self.fair:
                listener.wanted.add(self._probe_channel)  # subscribed when it connects
            listener.keep_connected()
            return int(reply[0])
        if wait is not None:
            wait.joined = True
        if int(reply[1]) == -1:
            # No expiry: when it frees is unknown. The core polls (and a release through
            # asynclock would still wake us); no valid_until, so no cached "busy" either.
            self._quiet = None
            return NO_EXPIRY
        retry = int(reply[1]) / 1000
        # Subscribed before we asked, still subscribed, and no wake-up for this name came
        # in while we asked: any release after our attempt will reach us as a message.
        quiet = (
            trusted
            and listener.epoch == epoch
            and k.channel_name in listener.confirmed
            and self._heard.get(name, 0) == heard
        )
        if wait is not None and quiet:
            wait.valid_until = t_send + retry
            wait.valid_bumps = bumps
        self._quiet = name if quiet else None
        return Busy(retry)

    async def extend(self, leases: Sequence[LeaseRef]) -> Sequence[ExtendResult]:
        if not leases:
            return []
        # The batch is every lease the backend holds: forget the rest (lost, dropped).
        tracked = self._leases
        self._leases = {r.owner: tracked[r.owner] for r in leases if r.owner in tracked}
        keys, args = extend_call(self.keys, leases)
        reply = await self.node.run("extend", keys, args)
        return [_extend_result(int(code)) for code in reply]

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        k = self.keys(name)
        self._leases.pop(owner, None)
        reply = await self.node.run(
            "release",
            k.release_keys,
            (owner.encode(), b"" if token is None else b"%d" % token, k.channel),
        )
        return bool(reply)

    async def validate(self, name: str, token: int) -> bool:
        value = await self.node.get(self.keys(name).lock)
        return value is not None and _token_of(value) == token

    async def abandon(self, name: str, owner: str) -> None:
        wait = self._forget_wait(name, owner)
        if wait is None or not wait.joined:
            return
        k = self.keys(name)
        await self.node.run(
            "abandon", k.release_keys, (wait.member.encode(), owner.encode(), k.channel)
        )

    # -- waking ----------------------------------------------------------------------------

    async def _subscribe(self, channel: str) -> None:
        listener = self.listener
        if self.fair and self._probe_channel not in listener.confirmed:
            await listener.subscribe(self._probe_channel, self.node.socket_timeout)
        await listener.subscribe(channel, self.node.socket_timeout)

    async def _unsubscribe(self, channel: str) -> None:
        await self.listener.unsubscribe(channel)

    def _on_message(self, channel: str, payload: bytes) -> None:
        name = self._channels.get(channel)
        if name is None:
            return
        waits = self._waits.get(name)
        if payload:
            # The name was handed to one waiter: wake only if it is ours.
            wait = waits.get(payload.decode()) if waits else None
            if wait is None:
                return
            wait.bumps += 1
        elif waits:
            for wait in waits.values():
                wait.bumps += 1
        self._heard_from(name)

    def _on_reset(self) -> None:
        self._drops += 1
        for waits in self._waits.values():
            for wait in waits.values():
                wait.bumps += 1
        for name in {*self._waits, *self._watchers}:
            self._heard_from(name)

    def _on_connect(self, run_id: str | None, reconnected: bool) -> None:
        """Connected (again). A new ``run_id`` means the server restarted: every lease it
        granted before is gone (loss within one round trip of the reconnect, not at the
        next renewal). Any reconnect asks for a renewal round now."""
        before, self.node.run_id = self.node.run_id, run_id or self.node.run_id
        if before is not None and run_id is not None and run_id != before:
            why = (
                f"the Redis server restarted (run_id {before} is now {run_id}); "
                "the leases it granted are gone"
            )
            drops = self._drops
            for owner, (name, seen) in list(self._leases.items()):
                if seen < drops or not reconnected:
                    del self._leases[owner]
                    self._notify_lost(name, owner, why)
        if reconnected:
            self._renew_now()

    def _forget_wait(self, name: str, owner: str) -> _Wait | None:
        waits = self._waits.get(name)
        if waits is None:
            return None
        wait = waits.pop(owner, None)
        if not waits:
            del self._waits[name]
        return wait

    # -- who holds it, breaking a lock ------------------------------------------------------

    async def holder(self, name: str) -> Holder | None:
        reply = await self.node.run("holder", (self.keys(name).lock,), ())
        return holder_from_reply(name, reply)

    async def break_lock(self, name: str) -> bool:
        k = self.keys(name)
        return bool(await self.node.run("break", k.release_keys, (k.channel,)))

    async def owner_of(self, name: str) -> tuple[str, int] | None:
        value = await self.node.get(self.keys(name).lock)
        token = None if value is None else _token_of(value)
        if value is None or token is None:
            return None  # free, or reserved for a waiter (no token yet)
        return value.rpartition(b":")[0].decode("utf-8", "replace"), token


def extend_call(keys: KeyCache, leases: Sequence[LeaseRef]) -> tuple[list[bytes], list[bytes]]:
    """KEYS and ARGV of the batched ``extend`` script: per lease its lock key, and
    ``owner:token`` plus the ttl in ms."""
    args: list[bytes] = []
    for ref in leases:
        args.append(f"{ref.owner}:{ref.token}".encode())
        args.append(b"%d" % ms(ref.ttl))
    return [keys(ref.name).lock for ref in leases], args


def _extend_result(code: int) -> ExtendResult:
    if code == 1:
        return True
    if code == 0:
        return Refused("the lock key is gone (expired or deleted)")
    return Refused("the lock is held by another owner")


def holder_from_reply(name: str, reply: Any) -> Holder | None:
    """A HOLDER script reply (``[b"owner:token", pttl_ms]`` or ``[]``) as a Holder."""
    if not reply:
        return None
    value, pttl = bytes(reply[0]), int(reply[1])
    token = _token_of(value)
    # A value not in asynclock's "owner:token" form (another tool's key): no token, and
    # the whole value stands for the owner.
    owner = value.rpartition(b":")[0] if token is not None else value
    # PTTL -1: a key with no expiry (not asynclock's): its remaining time is unknown.
    return Holder(name, owner.decode("utf-8", "replace"), token, pttl / 1000 if pttl >= 0 else None)


def _token_of(value: bytes) -> int | None:
    head, sep, tail = value.rpartition(b":")
    if not sep or not head or value.startswith(b"~"):
        return None
    try:
        return int(tail)
    except ValueError:
        return None


#: Driver options a redis:// URL query may carry (the driver reads them, not redis-py).
_URL_DRIVER_OPTIONS = {"restart_grace"}
#: What asynclock sets on every Redis connection itself (a URL or option may not).
_SET_BY_ASYNCLOCK = {
    "decode_responses": "asynclock reads raw bytes (decode_responses=False)",
}
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

    parts = urlsplit(url)
    if parts.scheme.lower() in ("redis", "rediss", "redlock"):
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
    keywords = _redis_keywords(parts.scheme.lower()) | keyword_options
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


def driver_from_url(url: str, **options: Any) -> RedisDriver:
    scheme = urlsplit(url).scheme.lower()
    check_redis_url(url, options, ours=_URL_DRIVER_OPTIONS, scheme=scheme)
    url, from_query = pop_query_options(url, _URL_DRIVER_OPTIONS)
    ours, rest = split_options({**from_query, **options})
    return RedisDriver(url, **ours, **rest)


__all__ = ("RedisDriver", "driver_from_url", "keys_for")
