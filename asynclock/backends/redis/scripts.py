"""The Lua scripts of the Redis drivers (one server, Redlock, Sentinel, Cluster): each with
its KEYS, ARGV and replies; the shared Lua helpers they are built from are in :mod:`.lua`."""

from __future__ import annotations

import hashlib

from .lua import CLOCK, HANDOFF, LEASE, RENEW
from .rw_scripts import RW_SCRIPTS
from .sem_scripts import SEM_SCRIPTS

# ACQUIRE (G1 exclusion, G2 monotonic tokens, fair queue).
# KEYS: lock, fence, queue, queue_exp, epoch[, scope fence: token_scope's counter, next_token's
# twin]. ARGV: owner, ttl_ms, mode, channel, grace_ms,
# probe; mode 0 = no queue (fair=False), 1 = respect the queue, 2 = respect it and wait in
# it; grace_ms: the restart grace (see grace_left); probe: this backend's probe id, or ''
# (not subscribed yet: a waiter that joined without one gets it added, keeping its place).
# Returns {token} when granted, {0, retry_after_ms} when busy, {0, ms_left, end_ms} in the
# restart grace (nobody holds it; nothing is granted before end_ms), {0, -1} when the lock
# key has no expiry (not ours: another tool's or a legacy key).
# The fence counter is never deleted (see next_token).
ACQUIRE = (
    CLOCK
    + LEASE
    + HANDOFF
    + """
local lock, fence, q, qx, epoch = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local owner, ttl, mode, chan = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local member = owner .. ':' .. ttl
local cur = redis.call('GET', lock)
if mode == '2' and ARGV[6] ~= '' then
  local plain = member
  member = member .. ':' .. ARGV[6]
  local score = redis.call('ZSCORE', q, plain)
  if score then  -- queued before our probe was subscribed: add it, keep the place
    local until_ms = redis.call('ZSCORE', qx, plain) or (clock() + 1000)
    redis.call('ZREM', q, plain)
    redis.call('ZREM', qx, plain)
    redis.call('ZADD', q, score, member)
    redis.call('ZADD', qx, until_ms, member)
  end
end
local floor
local function grant()
  if floor == nil then floor = token_floor(epoch) end
  local token
  if KEYS[6] then
    token = scoped_token(fence, KEYS[6], floor)
  else
    token = next_token(fence, floor)
  end
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
local left, grace, ends = nil, 0, nil
if cur == false then
  grace, ends, floor = grace_left(epoch, ARGV[5])
end
if grace > 0 then
  left = grace  -- In the restart grace: wait (and queue) as if the name were held.
elseif cur == false then
  if mode == '0' then return grant() end
  local first = head(q, qx, lock)
  if first == nil or first == member then return grant() end
  left = handoff(lock, q, qx, chan, first)
else
  left = redis.call('PTTL', lock)
end
local no_expiry = left == -1
if left == nil or left < 0 then left = 0 end
if mode == '2' then
  local now, t = clock()
  redis.call('ZADD', q, 'NX', t[1] .. string.format('%06d', tonumber(t[2])), member)
  local life = left + math.floor(left / 5) + 200
  redis.call('ZADD', qx, now + life, member)
  if redis.call('PTTL', q) < life then
    redis.call('PEXPIRE', q, life)
    redis.call('PEXPIRE', qx, life)
  end
end
if no_expiry then return {0, -1} end
if grace > 0 then return {0, left, ends} end
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
    CLOCK
    + LEASE
    + HANDOFF
    + """
local lock, q, qx = KEYS[1], KEYS[2], KEYS[3]
local owner, token, chan = ARGV[1], ARGV[2], ARGV[3]
local cur = redis.call('GET', lock)
if cur == false then return 0 end
local held = owned(cur, owner, token)
if held == nil then return 0 end
free(lock, q, qx, chan)
if held then return 1 end
return 0
"""
)

# ABANDON: a queued waiter gave up. KEYS: lock, queue, queue_exp.
# ARGV: member ("owner:ttl_ms", with or without ":probe": both are removed), owner, channel.
# If the name was reserved for this waiter, pass the reservation on to the next one.
# Returns 1.
ABANDON = (
    CLOCK
    + HANDOFF
    + """
local lock, q, qx = KEYS[1], KEYS[2], KEYS[3]
local plain = string.match(ARGV[1], '^([^:]*:%d+)') or ARGV[1]
for _, m in ipairs({ARGV[1], plain}) do
  redis.call('ZREM', q, m)
  redis.call('ZREM', qx, m)
end
if redis.call('GET', lock) == '~' .. ARGV[2] then
  redis.call('DEL', lock)
  handoff(lock, q, qx, ARGV[3], head(q, qx, lock))
end
return 1
"""
)

# REDLOCK_ACQUIRE (Redlock phase 1; G1 exclusion, G2 monotonic tokens): ACQUIRE in mode 0
# (no waiter queue: Redlock never queues) with nothing that mode does not need, so each
# node spends less time per call (every node's time is on the path of every acquisition).
# KEYS: lock, fence, epoch[, scope fence]. ARGV: owner, ttl_ms, grace_ms (the restart grace,
# per node).
# Returns {token} when granted, {0, retry_after_ms} when busy, {0, ms_left, end_ms} in the
# restart grace, {0, -1} when the lock key has no expiry (as ACQUIRE). The counter is seeded
# from TIME exactly as in ACQUIRE (next_token).
REDLOCK_ACQUIRE = (
    CLOCK
    + LEASE
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
local left, ends, floor = grace_left(KEYS[3], ARGV[3])
if left > 0 then return {0, left, ends} end
local token
if KEYS[4] then
  token = scoped_token(fence, KEYS[4], floor)
else
  token = next_token(fence, floor)
end
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
    CLOCK
    + LEASE
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

# REDLOCK_RELEASE_MANY: REDLOCK_RELEASE for many locks of one node in one call (releases
# made while one is in flight go out together: issue 45 item 3). KEYS: the lock keys; ARGV:
# per key its owner, token ("" if none) and channel. Returns per key 1 if it deleted our
# held key, else 0 (as REDLOCK_RELEASE).
REDLOCK_RELEASE_MANY = (
    CLOCK
    + LEASE
    + """
local out = {}
for i = 1, #KEYS do
  local owner = ARGV[3 * i - 2]
  out[i] = 0
  local cur = redis.call('GET', KEYS[i])
  if cur ~= false then
    local held = owned(cur, owner, ARGV[3 * i - 1])
    if held ~= nil then
      redis.call('DEL', KEYS[i])
      redis.call('PUBLISH', ARGV[3 * i], '-' .. owner)
      if held then out[i] = 1 end
    end
  end
end
return out
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

# HOLDER: who holds the lock, in one round trip. KEYS: lock, epoch. Returns {"owner:token",
# pttl_ms} while a lease holds it, {"", ms_left, end_ms} while the database's restart grace
# runs (see grace_left; a grace starts with the first acquire that finds the epoch missing,
# or marked as a failover's),
# {} when it is free or only reserved for a waiter.
HOLDER = """
local cur = redis.call('GET', KEYS[1])
if not cur or string.sub(cur, 1, 1) == '~' then
  local ends = tonumber(string.match(redis.call('GET', KEYS[2]) or '', '^(%d+)'))
  if ends then
    local t = redis.call('TIME')
    local left = ends - (tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
    if left > 0 then return {'', left, ends} end
  end
  return {}
end
return {cur, redis.call('PTTL', KEYS[1])}
"""

# BREAK (operators; G2 kept: the fence counter is untouched, so the next token is larger):
# delete whoever's lease holds the lock, then hand the name to the next waiter as RELEASE
# does. The broken owner's next EXTEND finds the key gone (refused). KEYS: lock, queue,
# queue_exp. ARGV: channel. Returns 1 if a lease was deleted, 0 if none held the lock (a
# waiter's reservation is left alone).
BREAK = (
    CLOCK
    + HANDOFF
    + """
local lock, q, qx, chan = KEYS[1], KEYS[2], KEYS[3], ARGV[1]
local cur = redis.call('GET', lock)
if not cur or string.sub(cur, 1, 1) == '~' then return 0 end
free(lock, q, qx, chan)
return 1
"""
)

# RECORD_PUT (idempotency records, G8): store the record of a name only while our lease
# holds it and no record of a larger token exists, the check and the write in one script.
# The record is "token\npayload", expiring after keep ms. KEYS: lock, record (one hash
# tag). ARGV: owner, token, payload, keep ms. Returns 1 if stored, 0 if not (not ours).
RECORD_PUT = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] .. ':' .. ARGV[2] then return 0 end
local old = redis.call('GET', KEYS[2])
if old then
  local t = tonumber(string.match(old, '^(%d+)\\n'))
  if t and t > tonumber(ARGV[2]) then return 0 end
end
redis.call('SET', KEYS[2], ARGV[2] .. '\\n' .. ARGV[3], 'PX', ARGV[4])
return 1
"""

# RECORD_DELETE: delete the record if the token wrote it. KEYS: record. ARGV: token.
# Returns 1 if deleted, else 0.
RECORD_DELETE = """
local old = redis.call('GET', KEYS[1])
if old and string.sub(old, 1, #ARGV[1] + 1) == ARGV[1] .. '\\n' then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""

# ADOPT (G1, G2 across a failover or a restart): run on a primary before a backend's first
# grant there (redis+sentinel://, and per hash slot on redis+cluster://). The era key holds
# the replication id of the primary the data was last adopted under. When the primary is
# another one now and was promoted from a replica (its master_replid2 is set), or a backend
# saw it restart with its data (kept on disk, or copied from a replica), the data may lack
# what was granted last (and the tokens handed out): the epoch key is marked "f<now ms>"
# (see grace_left: a restart grace from now, and every later token above now ms * 1000).
# Any other change (no era yet on a primary never promoted, a restart that lost the data:
# the epoch key is gone with it) is only recorded. The mark errs towards a grace: a slot a
# cluster migrated to a once-promoted primary waits one too.
# KEYS: epoch, era (one hash slot). ARGV: master_replid, master_replid2, restarted ('1':
# this backend saw the server restart). Returns 1 if it marked, else 0.
ADOPT = """
local era = redis.call('GET', KEYS[2])
if era == ARGV[1] then return 0 end
redis.call('SET', KEYS[2], ARGV[1])
local promoted = string.find(ARGV[2], '[^0]') ~= nil
local kept = redis.call('EXISTS', KEYS[1]) == 1
if not promoted and not (kept and ARGV[3] == '1') then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('SET', KEYS[1], 'f' .. string.format('%d', now))
return 1
"""

# SCOPE_NEXT (G2 per token scope on redis+cluster://, whose scope counter is in another slot
# than the name's): the scope's next token, above t (what the name's own counter just gave
# the grant) and above the slot's failover floor (see grace_left); RAISE_FENCE then gives it
# to the lease. KEYS: the scope's fence counter, its slot's epoch key. ARGV: t.
# Returns the token.
SCOPE_NEXT = (
    CLOCK
    + LEASE
    + """
return next_token(KEYS[1], math.max(token_floor(KEYS[2]), tonumber(ARGV[1])))
"""
)

# CLUSTER_EXTEND (G5 owner-checked, G7 same token): EXTEND for the leases of one Redis
# Cluster node, whose lock keys are in many hash slots. Redis (>= 7.0) lets a script with
# this flag touch keys of several slots as long as they live on the node; the keys are
# ARGV (a command's KEYS must share one slot), KEYS[1] one of them (it routes the call).
# ARGV: for lease i, ARGV[3i-2] = lock key, ARGV[3i-1] = "owner:token", ARGV[3i] = ttl_ms.
# Returns one entry per lease: 1 extended, 0 key gone, -1 held by someone else, 2 the key's
# slot is not on this node (moved: ask its owner).
CLUSTER_EXTEND = (
    "#!lua flags=allow-cross-slot-keys\n"
    + RENEW
    + """
local out = {}
for i = 1, #ARGV / 3 do
  local key = ARGV[3 * i - 2]
  local cur = redis.pcall('GET', key)
  if type(cur) == 'table' and cur.err then
    out[i] = 2
  else
    out[i] = renew(cur, key, ARGV[3 * i - 1], ARGV[3 * i])
  end
end
return out
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
    "redlock_release_many": REDLOCK_RELEASE_MANY,
    "holder": HOLDER,
    "break": BREAK,
    "record_put": RECORD_PUT,
    "record_delete": RECORD_DELETE,
    "adopt": ADOPT,
    "cluster_extend": CLUSTER_EXTEND,
    "scope_next": SCOPE_NEXT,
    **SEM_SCRIPTS,
    **RW_SCRIPTS,
}
#: Scripts not loaded at open (loaded on their first NOSCRIPT): only redis+sentinel:// and
#: redis+cluster:// run them (a redis:// or redlock:// open loads no more than it did), or
#: Redlock only when releases meet (REDLOCK_RELEASE_MANY); CLUSTER_EXTEND's flags need
#: Redis >= 7.0.
LAZY = frozenset(
    {"adopt", "cluster_extend", "scope_next", "redlock_release_many", *SEM_SCRIPTS, *RW_SCRIPTS}
)
#: EVALSHA digests (the same on every server: SHA1 of the script text).
SHAS = {key: hashlib.sha1(text.encode()).hexdigest().encode() for key, text in SCRIPTS.items()}

# Modes of ACQUIRE.
NO_QUEUE, RESPECT_QUEUE, JOIN_QUEUE = b"0", b"1", b"2"

#: Idle pub/sub subscriptions kept open (so a name locked again soon costs no SUBSCRIBE).
MAX_IDLE_SUBSCRIPTIONS = 256
