"""The Lua of read-write locks on one Redis server (:mod:`.rwlock`; the rules are
:mod:`asynclock._core.rw_store`'s): one script per grant, renewal and release, each
atomic. A read-write lock ``name`` has three keys, apart from its lock's and its
semaphore's (all under the hash tag of the name):

* ``<prefix>rw:{name}`` — a hash: ``e`` (the epoch: the last write hold's token, never
  deleted while the hash lives; a missing one is seeded from TIME in ms * 1000, so epochs
  keep rising after a restart that lost the data, as a lock's counter does; after a
  failover it jumps above the floor ADOPT set, as a lock's token does), ``w`` and
  ``wx`` (the writer's owner and expiry in the server's Unix ms). It expires a week after
  the last grant or renewal (redisson#6302); the epoch then starts again from TIME, above
  every earlier one;
* ``<prefix>rw:{name}:r`` — a sorted set of the readers: member = owner, score = expiry;
* ``<prefix>rw:{name}:i`` — a sorted set of the waiting writers' intents, the same way.
"""

from __future__ import annotations

from .lua import CLOCK, LEASE

_NOW = """
local KEEP_MS = 604800000
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local h, r, i = KEYS[1], KEYS[2], KEYS[3]
local function writer_live()
  local wx = tonumber(redis.call('HGET', h, 'wx') or '0')
  if wx > now then return wx end
  return nil
end
"""

# RW_GRANT. KEYS: hash, readers, intents, the database's epoch key. ARGV: mode ('r' or
# 'w'), owner, ttl_ms, intend ('1': a waiting writer records or renews its intent when
# busy), grace_ms. Returns {1, token} when granted, else {-1, why, ms until what blocks
# expires or -1}: why 1 = a writer holds it, 2 = readers hold it, 3 = a writer is waiting,
# 4 = the restart grace (after data loss a hold granted before may still be in use).
RW_GRANT = (
    CLOCK
    + LEASE
    + _NOW
    + """
local mode, owner, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', r, '-inf', now)
redis.call('ZREMRANGEBYSCORE', i, '-inf', now)
local why, left = 0, -1
local wx = writer_live()
if wx then
  why, left = 1, wx - now
elseif mode == 'r' then
  if redis.call('ZCARD', i) > 0 then return {-1, 3, -1} end
elseif redis.call('ZCARD', r) > 0 then
  local first = redis.call('ZRANGE', r, 0, 0, 'WITHSCORES')
  why, left = 2, tonumber(first[2]) - now
end
if why > 0 then
  if ARGV[4] == '1' then
    redis.call('ZADD', i, now + ttl, owner)
    redis.call('PEXPIRE', i, KEEP_MS)
  end
  return {-1, why, left}
end
local grace, _, floor = grace_left(KEYS[4], ARGV[5])
if grace > 0 then return {-1, 4, grace} end
local e = redis.call('HGET', h, 'e')
if not e then
  -- (a string: Lua would print so large a number in exponent notation)
  e = t[1] .. string.format('%03d', math.floor(tonumber(t[2]) / 1000)) .. '000'
  redis.call('HSET', h, 'e', e)
end
if tonumber(e) <= floor then
  -- After a failover (ADOPT's floor): the epoch jumps above every one the old primary
  -- handed out, so a resource fenced by an old writer refuses none of the new holds.
  e = string.format('%d', floor + 1)
  redis.call('HSET', h, 'e', e)
end
local token
if mode == 'r' then
  redis.call('ZADD', r, now + ttl, owner)
  redis.call('PEXPIRE', r, KEEP_MS)
  token = tonumber(e)
else
  token = redis.call('HINCRBY', h, 'e', 1)
  redis.call('ZREM', i, owner)
  redis.call('HSET', h, 'w', owner, 'wx', string.format('%d', now + ttl))
end
redis.call('PEXPIRE', h, KEEP_MS)
return {1, token}
"""
)

# RW_EXTEND. KEYS: hash, readers, intents. ARGV[1]: mode; then for hold k,
# ARGV[3k-1 .. 3k+1] = owner, token, ttl_ms. Returns one entry per hold: 1 renewed, 0
# expired or not ours.
RW_EXTEND = (
    _NOW
    + """
local mode = ARGV[1]
local e = redis.call('HGET', h, 'e')
local out = {}
for k = 1, (#ARGV - 1) / 3 do
  local owner, token, ttl = ARGV[3 * k - 1], ARGV[3 * k], tonumber(ARGV[3 * k + 1])
  out[k] = 0
  if e == token then
    if mode == 'r' then
      local score = redis.call('ZSCORE', r, owner)
      if score and tonumber(score) > now then
        redis.call('ZADD', r, 'XX', now + ttl, owner)
        redis.call('PEXPIRE', r, KEEP_MS)
        out[k] = 1
      end
    elseif writer_live() and redis.call('HGET', h, 'w') == owner then
      redis.call('HSET', h, 'wx', string.format('%d', now + ttl))
      out[k] = 1
    end
  end
end
redis.call('PEXPIRE', h, KEEP_MS)
return out
"""
)

# RW_RELEASE. KEYS: hash, readers, intents. ARGV: mode ('r', 'w', or 'i': withdraw an
# intent), owner, token ('' = unknown), the wake channel (PUBLISHed to when a hold or an
# intent is removed: waiters elsewhere try again). Returns 1 if our live hold (or intent)
# was removed.
RW_RELEASE = (
    _NOW
    + """
local mode, owner, token, chan = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local function freed()
  if chan then redis.call('PUBLISH', chan, '') end
  return 1
end
if mode == 'i' then
  if redis.call('ZREM', i, owner) == 1 then return freed() end
  return 0
end
if token ~= '' and redis.call('HGET', h, 'e') ~= token then return 0 end
if mode == 'r' then
  local score = redis.call('ZSCORE', r, owner)
  if score and tonumber(score) > now then
    redis.call('ZREM', r, owner)
    return freed()
  end
elseif writer_live() and redis.call('HGET', h, 'w') == owner then
  redis.call('HDEL', h, 'w', 'wx')
  return freed()
end
return 0
"""
)

# RW_HOLDERS (read-only). KEYS: hash, readers, intents. Returns {epoch or '0', {writer,
# ms left} or {}, {reader, ms left, ...}, {intent's owner, ms left, ...}}.
RW_HOLDERS = (
    _NOW
    + """
local function live(key)
  local out = {}
  local found = redis.call('ZRANGEBYSCORE', key, '(' .. now, '+inf', 'WITHSCORES')
  for k = 1, #found, 2 do
    out[#out + 1] = found[k]
    out[#out + 1] = tonumber(found[k + 1]) - now
  end
  return out
end
local w = {}
local wx = writer_live()
if wx then w = {redis.call('HGET', h, 'w'), wx - now} end
return {redis.call('HGET', h, 'e') or '0', w, live(r), live(i)}
"""
)

RW_SCRIPTS = {
    "rw_grant": RW_GRANT,
    "rw_extend": RW_EXTEND,
    "rw_release": RW_RELEASE,
    "rw_holders": RW_HOLDERS,
}
