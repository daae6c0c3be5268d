"""Limiter storages tuned for this service's request path, chosen by `storage_uri()`.

The pipeline counts a request with one increment per limit (petstore.overrides.count_with)
and shows the limit nearest to running out in X-RateLimit-*, so it needs each window's count
and end. Two changes to the `limits` storages, found by profiling the request path:

- Both: `incr_with_expiry` returns the count and the window's end together: on Redis in the
  same Lua call (two round trips per request, one per limit), in memory under one lock and
  without limits' error-wrapping layers around each of incr, get and get_expiry.
- Memory: limits' MemoryStorage starts a timer thread whenever its last one has finished,
  which under steady traffic means a new thread every few requests. Expired windows are
  already dropped when read; this one also sweeps the rest once a minute, in line.
"""

from __future__ import annotations

import time
from typing import Any

from limits.storage import (
    MemoryStorage,
    RedisClusterStorage,
    RedisSentinelStorage,
    RedisStorage,
)

# INCRBY, set the expiry on a new window, and return the count with the window's time to live.
INCR_EXPIRE_TTL = b"""
local current = redis.call("incrby", KEYS[1], ARGV[2])
if tonumber(current) == tonumber(ARGV[2]) then
    redis.call("expire", KEYS[1], ARGV[1])
end
return {current, redis.call("pttl", KEYS[1])}
"""

SCHEME_PREFIX = "petstore+"
SWEEP_SECONDS = 60.0


def storage_uri(configured: str, tuned: bool = True) -> str:
    """The URI flask-limiter gets for RATELIMIT_STORAGE_URI: ours for redis, Sentinel, Cluster and
    memory, if `tuned` (the bench measures limits' own storages with tuned=False)."""
    if tuned and configured.startswith(
        ("redis://", "rediss://", "memory://", "redis+sentinel://", "redis+cluster://")
    ):
        return SCHEME_PREFIX + configured
    return configured


class CountingRedisStorage(RedisStorage):
    """redis:// whose increment also returns the window's expiry, in the same round trip."""

    STORAGE_SCHEME = ["petstore+redis", "petstore+rediss"]

    def __init__(self, uri: str, **options: Any) -> None:
        super().__init__(uri.removeprefix(SCHEME_PREFIX), **options)

    def initialize_storage(self, uri: str) -> None:
        super().initialize_storage(uri)
        self.lua_incr_expire_ttl = self.get_connection().register_script(INCR_EXPIRE_TTL)

    def incr_with_expiry(self, key: str, expiry: int, amount: int = 1) -> tuple[int, float]:
        """Add `amount` to the key's window (started with `expiry` s when new): (count, end)."""
        count, ttl_ms = self.lua_incr_expire_ttl([self.prefixed_key(key)], [expiry, amount])
        return int(count), time.time() + max(int(ttl_ms), 0) / 1000

    def incr(self, key: str, expiry: int, amount: int = 1) -> int:
        return self.incr_with_expiry(key, expiry, amount)[0]


class SweepingMemoryStorage(MemoryStorage):
    """memory:// without a timer thread per burst of requests: expired windows swept in line."""

    STORAGE_SCHEME = ["petstore+memory"]

    def __init__(self, uri: str | None = None, **options: Any) -> None:
        super().__init__(uri, **options)
        self.next_sweep = time.time() + SWEEP_SECONDS

    def incr_with_expiry(self, key: str, expiry: float, amount: int = 1) -> tuple[int, float]:
        """Add `amount` to the key's window (started with `expiry` s when new): (count, end)."""
        now = time.time()
        if now >= self.next_sweep:
            self.sweep(now)
        with self.locks[key]:
            if self.expirations.get(key, 0) <= now:  # no window yet, or it has ended
                self.storage[key] = 0
                self.expirations[key] = now + expiry
            count = self.storage[key] = self.storage[key] + amount
            return count, self.expirations[key]

    def incr(self, key: str, expiry: float, amount: int = 1) -> int:
        return self.incr_with_expiry(key, expiry, amount)[0]

    def sweep(self, now: float) -> None:
        """Forget every window that has ended."""
        self.next_sweep = now + SWEEP_SECONDS
        for key, expires_at in list(self.expirations.items()):
            if expires_at <= now:
                self.storage.pop(key, None)
                self.expirations.pop(key, None)
                self.locks.pop(key, None)


class CountingSentinelStorage(CountingRedisStorage, RedisSentinelStorage):
    """redis+sentinel://: the same one-call count and expiry, on the master Sentinel names.

    The master's client asks the sentinels again on every new connection, so after a failover
    the counting goes on at the promoted replica without a restart; the script is loaded
    there on first use.
    """

    STORAGE_SCHEME = ["petstore+redis+sentinel"]


class CountingClusterStorage(CountingRedisStorage, RedisClusterStorage):
    """redis+cluster://: the same one-call count and expiry; the script touches one key, so one slot."""

    STORAGE_SCHEME = ["petstore+redis+cluster"]
