"""The Lua of semaphores on one Redis server (:mod:`.semaphore`): one script per grant,
renewal and release, each atomic. A semaphore ``name`` has two keys, apart from its lock's
(both under the hash tag of the name):

* ``<prefix>sem:{name}`` — a sorted set of the live permits: member = the slot
  ("0" .. limit-1), score = its expiry in the server's Unix ms;
* ``<prefix>sem:{name}:h`` — a hash: ``limit`` (of the live permits), ``o<slot>`` (the
  slot's owner), ``t<slot>`` (the slot's last token: never deleted, so each slot's token
  only rises; a missing one is seeded from TIME in ms * 1000, so tokens keep rising after
  a restart that lost the data, as a lock's counter does; after a failover a slot's next
  token is above the floor ADOPT set, as a lock's is). At most 2 * limit + 1 fields.
  It expires a week after the last grant or renewal (so names used once do not pile up,
  redisson#6302); the slots' tokens then start again from TIME, above every earlier one;
* ``<prefix>sem:{name}:q`` and ``<prefix>sem:{name}:qx`` — the wait queue of places
  (first come, first served: ``_core/permit_store.py``), two sorted sets of the waiters'
  owners: by arrival (score: the last place's + 1, so a kept place keeps its position) and
  by when the place lapses (the server's Unix ms). Every grant first drops the lapsed
  places; both keys expire a week after the last place was kept (gone sooner: with their
  last place). Lost in a failover or a restart that lost the data: that costs the order of
  the waiters then, never the limit.
"""

from __future__ import annotations

from .lua import CLOCK, LEASE

_NOW = """
local KEEP_MS = 604800000
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# SEM_GRANT. KEYS: set, hash, the database's epoch key, places, place expiries. ARGV:
# owner, ttl_ms, limit, grace_ms, queue ('1': when not granted, keep the owner's place or
# take one at the end), place_ms (how long a kept place lasts). Granted only when the live
# permits and the live places ahead of the owner's (all of them, if it has none) are fewer
# than the limit; the grant removes the owner's place. Returns {slot, token} when granted,
# {-1, ms until the first permit expires} when every permit is held or the server is in its
# restart grace (as lock grants: after data loss a permit granted before may still be in
# use), {-1, -1} when a permit is free but waiters ahead of the owner get it, {-2, the
# limit of the live permits} when that is not ARGV[3].
SEM_GRANT = (
    CLOCK
    + LEASE
    + _NOW
    + """
local set, h, q, qx = KEYS[1], KEYS[2], KEYS[4], KEYS[5]
local owner, lim = ARGV[1], tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', set, '-inf', now)
local n = redis.call('ZCARD', set)
if n > 0 then
  local held = tonumber(redis.call('HGET', h, 'limit'))
  if held and held ~= lim then return {-2, held} end
end
-- Drop the lapsed places (and, should one key have been evicted without the other, the
-- places the two no longer agree on: a place without its expiry would never lapse).
for _, m in ipairs(redis.call('ZRANGEBYSCORE', qx, '-inf', now)) do
  redis.call('ZREM', q, m)
end
redis.call('ZREMRANGEBYSCORE', qx, '-inf', now)
if redis.call('ZCARD', q) ~= redis.call('ZCARD', qx) then
  for _, m in ipairs(redis.call('ZRANGE', q, 0, -1)) do
    if not redis.call('ZSCORE', qx, m) then redis.call('ZREM', q, m) end
  end
  for _, m in ipairs(redis.call('ZRANGE', qx, 0, -1)) do
    if not redis.call('ZSCORE', q, m) then redis.call('ZREM', qx, m) end
  end
end
local ahead = redis.call('ZRANK', q, owner) or redis.call('ZCARD', q)
-- Not granted: keep the owner's place (its position unchanged) or take one at the end.
local function full(left)
  if ARGV[5] == '1' then
    if not redis.call('ZSCORE', q, owner) then
      local last = redis.call('ZRANGE', q, -1, -1, 'WITHSCORES')[2]
      redis.call('ZADD', q, tonumber(last or '0') + 1, owner)
    end
    redis.call('ZADD', qx, now + tonumber(ARGV[6]), owner)
    redis.call('PEXPIRE', q, KEEP_MS)
    redis.call('PEXPIRE', qx, KEEP_MS)
  end
  return {-1, left}
end
if n + ahead >= lim then
  if n < lim then return full(-1) end  -- free, but for waiters ahead of the owner
  local first = redis.call('ZRANGE', set, 0, 0, 'WITHSCORES')
  return full(tonumber(first[2]) - now)
end
local grace, _, floor = grace_left(KEYS[3], ARGV[4])
if grace > 0 then return full(grace) end
redis.call('ZREM', q, owner)
redis.call('ZREM', qx, owner)
-- At most n slots are live, so one of 0 .. n is free.
local slot = 0
while redis.call('ZSCORE', set, slot) do slot = slot + 1 end
local token = redis.call('HINCRBY', h, 't' .. slot, 1)
if token == 1 then
  -- (a string: Lua would print so large a number in exponent notation)
  local seed = t[1] .. string.format('%03d', math.floor(tonumber(t[2]) / 1000)) .. '001'
  redis.call('HSET', h, 't' .. slot, seed)
  token = tonumber(seed)
end
if token <= floor then
  -- After a failover (ADOPT's floor): above every token the old primary handed out.
  token = floor + 1
  redis.call('HSET', h, 't' .. slot, string.format('%d', token))
end
redis.call('HSET', h, 'o' .. slot, owner, 'limit', lim)
redis.call('PEXPIRE', h, KEEP_MS)
redis.call('ZADD', set, now + tonumber(ARGV[2]), slot)
return {slot, token}
"""
)

# SEM_EXTEND. KEYS: set, hash. ARGV: for permit i, ARGV[4i-3 .. 4i] = slot, owner, token,
# ttl_ms. Returns one entry per permit: 1 renewed, 0 expired or not ours.
SEM_EXTEND = (
    _NOW
    + """
local set, h = KEYS[1], KEYS[2]
local out = {}
for i = 1, #ARGV / 4 do
  local slot, owner, token = ARGV[4 * i - 3], ARGV[4 * i - 2], ARGV[4 * i - 1]
  local score = redis.call('ZSCORE', set, slot)
  if score and tonumber(score) > now and redis.call('HGET', h, 'o' .. slot) == owner
      and redis.call('HGET', h, 't' .. slot) == token then
    redis.call('ZADD', set, 'XX', now + tonumber(ARGV[4 * i]), slot)
    redis.call('PEXPIRE', h, KEEP_MS)
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
"""
)

# SEM_RELEASE. KEYS: set, hash. ARGV: slot ('' = unknown: an interrupted grant, look at
# every live slot), owner, token ('' = unknown), the wake channel (PUBLISHed to when a
# permit is freed: waiters elsewhere try again). Returns 1 if our live permit was freed.
SEM_RELEASE = (
    _NOW
    + """
local set, h = KEYS[1], KEYS[2]
local owner, token = ARGV[2], ARGV[3]
local slots
if ARGV[1] == '' then
  slots = redis.call('ZRANGEBYSCORE', set, '(' .. now, '+inf')
else
  slots = {ARGV[1]}
end
for _, slot in ipairs(slots) do
  local score = redis.call('ZSCORE', set, slot)
  if score and tonumber(score) > now and redis.call('HGET', h, 'o' .. slot) == owner
      and (token == '' or redis.call('HGET', h, 't' .. slot) == token) then
    redis.call('ZREM', set, slot)
    redis.call('HDEL', h, 'o' .. slot)
    if ARGV[4] then redis.call('PUBLISH', ARGV[4], '') end
    return 1
  end
end
return 0
"""
)

# SEM_WITHDRAW. KEYS: places, place expiries. ARGV: owner, the wake channel (PUBLISHed to
# when a place was removed: the waiters behind it may now be served). Returns 1 if the
# owner had a place.
SEM_WITHDRAW = """
local removed = redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
if removed == 1 and ARGV[2] then redis.call('PUBLISH', ARGV[2], '') end
return removed
"""

# SEM_HOLDERS (read-only). KEYS: set, hash. Returns {limit or '', then per live permit by
# slot: slot, owner, token, ms left}.
SEM_HOLDERS = (
    _NOW
    + """
local set, h = KEYS[1], KEYS[2]
local out = {redis.call('HGET', h, 'limit') or ''}
for _, slot in ipairs(redis.call('ZRANGEBYSCORE', set, '(' .. now, '+inf')) do
  local owner = redis.call('HGET', h, 'o' .. slot)
  if owner then
    local left = tonumber(redis.call('ZSCORE', set, slot)) - now
    out[#out + 1] = slot
    out[#out + 1] = owner
    out[#out + 1] = redis.call('HGET', h, 't' .. slot) or '0'
    out[#out + 1] = left
  end
end
return out
"""
)

SEM_SCRIPTS = {
    "sem_grant": SEM_GRANT,
    "sem_extend": SEM_EXTEND,
    "sem_release": SEM_RELEASE,
    "sem_withdraw": SEM_WITHDRAW,
    "sem_holders": SEM_HOLDERS,
}
