"""Limiter storages tuned for this service's request path, chosen by `storage_uri()`.

flask-limiter counts a request with one increment per limit; then the X-RateLimit-* header
policy reads each limit's count and expiry back. Two changes to the `limits` storages, found
by profiling the request path:

- Redis: the increment returns the count and the time to live in the same Lua call, and they
  are kept for the rest of the request (per thread), so the header policy needs no more
  round trips: two per request instead of six.
- Memory: limits' MemoryStorage starts a timer thread whenever its last one has finished,
  which under steady traffic means a new thread every few requests. Expired windows are
  already dropped when read; this one also sweeps the rest once a minute, in line.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from limits.storage import MemoryStorage, RedisStorage

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
    """The URI flask-limiter gets for RATELIMIT_STORAGE_URI: ours for redis and memory, if `tuned`."""
    if tuned and configured.startswith(("redis://", "rediss://", "memory://")):
        return SCHEME_PREFIX + configured
    return configured


class CountingRedisStorage(RedisStorage):
    """redis:// that remembers each key's count and expiry after an increment, per thread."""

    STORAGE_SCHEME = ["petstore+redis", "petstore+rediss"]

    def __init__(self, uri: str, **options: Any) -> None:
        super().__init__(uri.removeprefix(SCHEME_PREFIX), **options)
        self.seen = threading.local()

    def initialize_storage(self, uri: str) -> None:
        super().initialize_storage(uri)
        self.lua_incr_expire_ttl = self.get_connection().register_script(INCR_EXPIRE_TTL)

    def forget(self, exc: BaseException | None = None) -> None:
        """Drop what this thread remembered: called when a request ends."""
        self.seen.counts = {}

    def remembered(self, key: str) -> tuple[int, float] | None:
        counts: dict[str, tuple[int, float]] = getattr(self.seen, "counts", {})
        return counts.get(key)

    def incr(self, key: str, expiry: int, amount: int = 1) -> int:
        count, ttl_ms = self.lua_incr_expire_ttl([self.prefixed_key(key)], [expiry, amount])
        if getattr(self.seen, "counts", None) is None:
            self.seen.counts = {}
        self.seen.counts[key] = (int(count), time.time() + max(int(ttl_ms), 0) / 1000)
        return int(count)

    def get(self, key: str) -> int:
        remembered = self.remembered(key)
        return remembered[0] if remembered else super().get(key)

    def get_expiry(self, key: str) -> float:
        remembered = self.remembered(key)
        return remembered[1] if remembered else super().get_expiry(key)

    def clear(self, key: str) -> None:
        getattr(self.seen, "counts", {}).pop(key, None)
        super().clear(key)


class SweepingMemoryStorage(MemoryStorage):
    """memory:// without a timer thread per burst of requests: expired windows swept in line."""

    STORAGE_SCHEME = ["petstore+memory"]

    def __init__(self, uri: str | None = None, **options: Any) -> None:
        super().__init__(uri, **options)
        self.next_sweep = time.time() + SWEEP_SECONDS

    def incr(self, key: str, expiry: float, amount: int = 1) -> int:
        now = time.time()
        if now >= self.next_sweep:
            self.sweep(now)
        self.get(key)  # drops the key if its window has ended
        with self.locks[key]:
            self.storage[key] += amount
            if self.storage[key] == amount:
                self.expirations[key] = now + expiry
            return self.storage[key]

    def sweep(self, now: float) -> None:
        """Forget every window that has ended."""
        self.next_sweep = now + SWEEP_SECONDS
        for key, expires_at in list(self.expirations.items()):
            if expires_at <= now:
                self.storage.pop(key, None)
                self.expirations.pop(key, None)
                self.locks.pop(key, None)
