"""The Redis fence: a Lua compare-and-set that writes only if the token is not stale (G8).

Works with any client that has redis-py's ``evalsha``/``eval`` (``redis.asyncio.Redis``);
nothing here imports ``redis``, so this module loads without it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Mapping
from typing import Any, Protocol

from .._core.exceptions import StaleToken
from .._core.observer import stale_token
from .._core.validation import check_token

# FENCED_WRITE (G8): raise the high-water mark and write, atomically, unless a newer token
# was already accepted. KEYS: mark, data. ARGV: token, op ('set' | 'hset' | 'del' |
# 'none'), then the op's arguments (set: value [, px_ms]; hset: field, value, ...).
# Returns {1, token} when written, {0, current_mark} when stale, {-1, mark value} when the
# mark is not a token, {-2, 'mark' | 'data', type} when that key has the wrong type
# (nothing is written in the last three cases).
# Tokens are compared exactly, as decimal strings: Lua numbers are doubles, which above
# 2**53 round (a stale token passed and the mark went down). Marks are plain decimals, as
# every version of this script wrote them.
FENCED_WRITE = """
-- s as decimal digits without leading zeros ('' for zero), or nil if s is not a
-- decimal integer below 10**19 (every token is below 2**63).
local function digits(s)
  if type(s) ~= 'string' or not string.match(s, '^%d+$') then return nil end
  s = string.gsub(s, '^0+', '')
  if #s > 19 then return nil end
  return s
end
-- a < b for two results of digits(): by length, then in two exact halves (< 2**53 each).
local function less(a, b)
  if #a ~= #b then return #a < #b end
  local n = #a - 9
  if n > 0 then
    local ha, hb = tonumber(string.sub(a, 1, n)), tonumber(string.sub(b, 1, n))
    if ha ~= hb then return ha < hb end
    a, b = string.sub(a, n + 1), string.sub(b, n + 1)
  end
  return (tonumber(a) or 0) < (tonumber(b) or 0)
end
local raw = redis.pcall('GET', KEYS[1])
if type(raw) == 'table' and raw.err then
  return {-2, 'mark', redis.call('TYPE', KEYS[1]).ok}
end
local mark = ''
if raw then
  mark = digits(raw)
  if mark == nil then return {-1, raw} end
end
local token = digits(ARGV[1])
if less(token, mark) then return {0, mark} end
local op = ARGV[2]
if op == 'hset' then
  local t = redis.call('TYPE', KEYS[2]).ok
  if t ~= 'hash' and t ~= 'none' then return {-2, 'data', t} end
end
redis.call('SET', KEYS[1], token)
if op == 'set' then
  if ARGV[4] then
    redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[4])
  else
    redis.call('SET', KEYS[2], ARGV[3])
  end
elseif op == 'hset' then
  redis.call('HSET', KEYS[2], unpack(ARGV, 3))
elseif op == 'del' then
  redis.call('DEL', KEYS[2])
end
return {1, token}
"""
_SHA = hashlib.sha1(FENCED_WRITE.encode()).hexdigest()


class _AsyncRedis(Protocol):
    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> Awaitable[Any]: ...

    def eval(self, script: str, numkeys: int, *keys_and_args: Any) -> Awaitable[Any]: ...


def mark_key(key: str, suffix: str = ":asynclock-fence") -> str:
    """The high-water-mark key of ``key``, in the same Redis Cluster hash slot.

    A key with a hash tag (``{user1}:profile``) keeps it; any other key becomes the tag.
    """
    start = key.find("{")
    if start >= 0 and key.find("}", start + 1) > start + 1:
        return key + suffix
    if "}" in key:
        raise ValueError(
            f"fence key {key!r} has a '}}' but no hash tag; give it one like '{{user1}}:x'"
        )
    return f"{{{key}}}{suffix}"


class RedisFence:
    """High-water marks next to your Redis data; every write is checked and done in one Lua call.

    ::

        fence = RedisFence()
        await fence.set(client, "invoice:42", payload, lease.token)   # raises StaleToken
        await fence.hset(client, "invoice:42", {"total": "10"}, lease.token)

    Equal tokens pass (the same holder writing again); a lower one raises
    :class:`~asynclock.StaleToken` and nothing is written. The mark lives at
    ``{key}:asynclock-fence`` (same hash slot as ``key``).
    """

    def __init__(self, suffix: str = ":asynclock-fence") -> None:
        if not isinstance(suffix, str) or not suffix or "{" in suffix or "}" in suffix:
            raise ValueError(f"suffix must be a non-empty str without braces, got {suffix!r}")
        self.suffix = suffix

    def __repr__(self) -> str:
        return f"RedisFence(suffix={self.suffix!r})"

    async def _run(self, client: _AsyncRedis, key: str, token: int, *args: Any) -> None:
        if not isinstance(key, str) or not key:
            raise ValueError(f"fence key must be a non-empty str, got {key!r}")
        token = check_token(token)
        keys = (mark_key(key, self.suffix), key)
        try:
            reply = await client.evalsha(_SHA, 2, *keys, token, *args)
        except Exception as exc:
            # redis-py raises NoScriptError (its message drops the NOSCRIPT prefix).
            if type(exc).__name__ != "NoScriptError" and "NOSCRIPT" not in str(exc):
                raise
            reply = await client.eval(FENCED_WRITE, 2, *keys, token, *args)
        code = int(reply[0])
        if code == 1:
            return
        if code == 0:
            stale_token("redis")
            raise StaleToken(key, token, int(reply[1]))
        if code == -1:
            raise ValueError(_not_a_token(keys[0], reply[1]) + "; nothing was written")
        which, kind = _text(reply[1]), _text(reply[2])
        if which == "mark":
            raise TypeError(
                f"fence mark {keys[0]!r} holds a Redis {kind}, not a string with a token; "
                "nothing was written"
            )
        raise TypeError(
            f"hset needs {key!r} to be a Redis hash, it is a {kind}; nothing was written"
        )

    async def set(
        self,
        client: _AsyncRedis,
        key: str,
        value: str | bytes,
        token: int,
        *,
        px: int | None = None,
    ) -> None:
        """``SET key value [PX px]`` if ``token`` is not stale; else raise StaleToken."""
        extra = () if px is None else (int(px),)
        await self._run(client, key, token, "set", value, *extra)

    async def hset(
        self, client: _AsyncRedis, key: str, mapping: Mapping[str, str | bytes | int], token: int
    ) -> None:
        """``HSET key field value …`` if ``token`` is not stale; else raise StaleToken."""
        if not mapping:
            raise ValueError("hset needs at least one field")
        flat: list[Any] = []
        for field, value in mapping.items():
            flat += [field, value]
        await self._run(client, key, token, "hset", *flat)

    async def delete(self, client: _AsyncRedis, key: str, token: int) -> None:
        """``DEL key`` if ``token`` is not stale; else raise StaleToken."""
        await self._run(client, key, token, "del")

    async def check(self, client: _AsyncRedis, key: str, token: int) -> None:
        """Only raise the mark (for a write made elsewhere); raise StaleToken if stale."""
        await self._run(client, key, token, "none")

    async def current(self, client: Any, key: str) -> int | None:
        """The newest token accepted for ``key``, or None."""
        mark = mark_key(key, self.suffix)
        try:
            value = await client.get(mark)
        except Exception as exc:
            if "WRONGTYPE" not in str(exc):
                raise
            raise TypeError(f"fence mark {mark!r} is not a Redis string: {exc}") from None
        if value is None:
            return None
        text = _text(value)
        if not (text.isascii() and text.isdigit()) or not 0 < int(text) < 2**63:
            raise ValueError(_not_a_token(mark, value))
        return int(text)


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _not_a_token(mark: str, value: object) -> str:
    return (
        f"fence mark {mark!r} holds {_text(value)!r}, not a fencing token (a decimal integer "
        "from 1 to 2**63-1); something other than the fence wrote it: delete the mark or "
        "use another suffix"
    )
