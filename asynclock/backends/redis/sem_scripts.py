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
  redisson#6302); the slots' tokens then start again from TIME, above every earlier one.
"""

from __future__ import annotations

from .lua import CLOCK, LEASE

_NOW = """
local KEEP_MS = 604800000
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# SEM_GRANT. KEYS: set, hash, the database's epoch key. ARGV: owner, ttl_ms, limit,
# grace_ms. Returns {slot, token} when granted, {-1, ms until the first permit expires}
# when every permit is held or the server is in its restart grace (as lock grants: after
# data loss a permit granted before may still be in use), {-2, the limit of the live
# permits} when that is not ARGV[3].
SEM_GRANT = (
    CLOCK
    + LEASE
    + _NOW
    + """
local set, h = KEYS[1], KEYS[2]
local lim = tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', set, '-inf', now)
local n = redis.call('ZCARD', set)
if n > 0 then
  local held = tonumber(redis.call('HGET', h, 'limit'))
  if held and held ~= lim then return {-2, held} end
end
if n >= lim then
  local first = redis.call('ZRANGE', set, 0, 0, 'WITHSCORES')
  return {-1, tonumber(first[2]) - now}
end
local grace, _, floor = grace_left(KEYS[3], ARGV[4])
if grace > 0 then return {-1, grace} end
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
redis.call('HSET', h, 'o' .. slot, ARGV[1], 'limit', lim)
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
    "sem_holders": SEM_HOLDERS,
}
