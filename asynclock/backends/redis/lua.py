"""The Lua the Redis scripts are built from (:mod:`.scripts`): the server's clock, the
lease steps (next token, hold, owner check, restart grace, token floor) and the hand-off to
the next waiter. Each helper says what it takes and returns, and which guarantee it keeps."""

from __future__ import annotations

# -- Lua ----------------------------------------------------------------------------------
#
# Values: the lock key holds "owner:token" while held, or "~owner" while a release has
# reserved the name for the waiter ``owner`` (who then claims it with ACQUIRE). Waiters are
# members "owner:ttl_ms:probe" (or "owner:ttl_ms": no probe yet) of two sorted sets: by
# arrival (queue) and by expiry (queue_exp). ``probe`` names the waiting backend's probe
# channel, "<prefix>w:<probe>", which that backend subscribes to while it lives: PUBLISH
# there answers 0 once its connection is gone (the process died).

# The server's clock, read at most once per call and only by a call that needs it (the
# steady-state acquire does not: the counter exists and the grace is over).
CLOCK = """
local clock_t
-- Now in Unix ms on the server's clock, and the TIME reply.
local function clock()
  if not clock_t then clock_t = redis.call('TIME') end
  return tonumber(clock_t[1]) * 1000 + math.floor(tonumber(clock_t[2]) / 1000), clock_t
end
"""

# Shared helpers for the scripts that take and free a lease (single node and Redlock).
LEASE = """
-- G2: the name's next token. INCR answers 1 only for a missing counter (a new name, or
-- data loss): it is then seeded from TIME in ms * 1000 before counting on, so tokens keep
-- rising across a restart that lost it. floor (0: none; see grace_left): after a failover
-- every token is above it, whatever the counter the new primary was handed.
local function next_token(fence, floor)
  local n = redis.call('INCR', fence)
  if n == 1 then
    local _, t = clock()
    local ms = math.floor(tonumber(t[2]) / 1000)
    redis.call('SET', fence, t[1] .. string.format('%03d', ms) .. '000')
    n = redis.call('INCR', fence)
  end
  if n <= floor then
    n = floor + 1
    redis.call('SET', fence, string.format('%d', n))
  end
  return n
end
-- G2 per token scope: the next token of the name's counter and of the scope's (both
-- seeded as above), whichever is larger; both counters end at it.
local function scoped_token(fence, scope, floor)
  local a, b = next_token(fence, floor), next_token(scope, floor)
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
-- G1 across data loss: the restart grace. The epoch key holds the Unix ms at which the
-- database's grace ends, one end for every request, and lives as long as the database's
-- data; "0" once the grace is over (so the steady state needs no TIME). When it is missing
-- (a new database, a flush, a restart that lost the data) a lease granted before may still
-- run in its holder, so nothing is granted until the server's start + grace ms: data
-- cannot have been lost before the server started, so a server up for longer than the
-- grace waits for nothing (an INFO that fails counts as just started).
-- After a failover (see ADOPT) it holds "f<ms>": the new primary may lack what the old one
-- granted last, so the grace counts from ms (when a backend first saw the new primary), and
-- from then on it carries ":<floor>" ("<end>:<floor>", "0:<floor>"): every token is above
-- floor = ms * 1000, above every token the old primary handed out before (G2; as for the
-- TIME seed: a name averages < 1,000 acquisitions per ms).
-- Returns the ms left (0: none), the end, and the token floor (0: none).
local function grace_left(epoch, grace)
  local kept = redis.call('GET', epoch)
  if kept == '0' then return 0, 0, 0 end
  local floor = 0
  local state, below = string.match(kept or '', '^(%d+):(%d+)$')
  if state then kept, floor = state, tonumber(below) end
  if kept == '0' then return 0, 0, floor end
  local now, t = clock()
  local ends = tonumber(kept or '')
  local failover = kept and tonumber(string.match(kept, '^f(%d+)$'))
  if failover then
    floor = failover * 1000
    ends = failover + tonumber(grace)
  elseif ends == nil then
    local info = redis.pcall('INFO', 'server')
    local up = type(info) == 'string' and tonumber(string.match(info, 'uptime_in_seconds:(%d+)'))
    -- The uptime is whole seconds of the clock (now's second minus the start's), so the
    -- start is before the second after now's second - up: take that, the latest it can
    -- be (never after now), so the grace is never short of a holder from before.
    local start = math.min(now, (tonumber(t[1]) - (up or 0) + 1) * 1000)
    ends = start + tonumber(grace)
  end
  local suffix = ''
  if floor > 0 then suffix = ':' .. string.format('%d', floor) end
  if ends <= now then
    redis.call('SET', epoch, '0' .. suffix)
    return 0, ends, floor
  end
  if tonumber(kept or '') == nil then
    redis.call('SET', epoch, string.format('%d', ends) .. suffix)
  end
  return ends - now, ends, floor
end
-- The token floor alone (for a grant that skips grace_left: a waiter's reservation).
local function token_floor(epoch)
  local kept = redis.call('GET', epoch)
  if kept == false or kept == '0' then return 0 end
  local below = string.match(kept, ':(%d+)$')
  if below then return tonumber(below) end
  local failover = tonumber(string.match(kept, '^f(%d+)$'))
  if failover then return failover * 1000 end
  return 0
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
HANDOFF = """
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
local function head(q, qx, lock)
  if redis.call('EXISTS', q) == 0 then return nil end
  local dead = redis.call('ZRANGEBYSCORE', qx, '-inf', (clock()), 'LIMIT', 0, 100)
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

-- Delete the lock key and hand the name to the oldest live waiter, if any.
local function free(lock, q, qx, chan)
  redis.call('DEL', lock)
  handoff(lock, q, qx, chan, head(q, qx, lock))
end
"""

# G5 owner-checked, G7 the same token: renew one lock key. Never re-creates a missing key.
RENEW = """
-- Extend key (whose value is cur) by ttl ms if it still holds value ("owner:token").
-- Returns 1 extended, 0 key gone, -1 held by someone else.
local function renew(cur, key, value, ttl)
  if cur == value then
    redis.call('PEXPIRE', key, ttl)
    return 1
  elseif cur == false then
    return 0
  end
  return -1
end
"""
