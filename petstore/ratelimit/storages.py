"""Limiter storages tuned for this service's request path, chosen by `storage_uri()`.

The pipeline counts a request in each of its limits' windows (petstore.ratelimit.limiter.count_windows)
and shows the limit nearest to running out in X-RateLimit-*, so it needs each window's count
and end. Two changes to the `limits` storages, found by profiling the request path:

- Both: `incr_windows` counts a request in every window of its budget, smallest first, and
  stops after the first one it overdraws, as flask-limiter's own loop over limits does; each
  window's count comes back with the window's end. On Redis that is one Lua call, one round
  trip per request whatever the number of limits (on Redis Cluster, one per window: the
  windows' keys may live in different slots). In memory, one lock per window and none of
  limits' error-wrapping layers around each of incr, get and get_expiry.
- Redis: each thread sends the scripts on a connection of its own, made on first use in the
  process that uses it. redis-py's client takes a connection from its pool and gives it back
  around every command, through its retry and observability layers, which cost more CPU than
  the command itself (bench/results/2026-11-27-quiet/create.md). A failed call closes the
  connection and raises, as the client would: the limiter then counts in its in-memory
  fallback until Redis answers again; the next call connects anew.
- Memory: limits' MemoryStorage starts a timer thread whenever its last one has finished,
  which under steady traffic means a new thread every few requests. Expired windows are
  already dropped when read; this one also sweeps the rest once a minute, in line.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from limits import RateLimitItem
from limits.storage import (
    MemoryStorage,
    RedisClusterStorage,
    RedisSentinelStorage,
    RedisStorage,
)

if TYPE_CHECKING:
    # Only for annotations: redis is imported by limits when a redis:// storage is made, and
    # a memory:// service never loads it.
    from redis.commands.core import Script
    from redis.connection import AbstractConnection

# For each window (KEYS[i], started with ARGV[2i] seconds when new, allowing ARGV[2i+1]): INCRBY
# ARGV[1], set the expiry of a new window, note the count and the window's time to live; stop
# after the first window over its limit. Last, Redis's clock (TIME: seconds, microseconds), after
# the writes (a script may not write after reading the clock on Redis before 5), so that every
# host names the same end of a window whatever its own clock says.
INCR_WINDOWS = b"""
local amount = tonumber(ARGV[1])
local counted = {}
for i, key in ipairs(KEYS) do
    local current = redis.call("incrby", key, amount)
    local ttl = redis.call("pttl", key)
    if ttl < 0 then  -- a new window (a count back at zero after a release keeps its end)
        redis.call("expire", key, ARGV[2 * i])
        ttl = ARGV[2 * i] * 1000
    end
    counted[#counted + 1] = current
    counted[#counted + 1] = ttl
    if current > tonumber(ARGV[2 * i + 1]) then
        break
    end
end
local now = redis.call("time")
counted[#counted + 1] = now[1]
counted[#counted + 1] = now[2]
return counted
"""

# A lease (petstore.ratelimit.leases): grant at most ARGV[1] requests of every window at once,
# no more than what is left unreserved in each window divided by ARGV[2] (the workers that
# share the key), but one while anything is left; none when a window is spent. The grant is
# counted in every window at once (started with ARGV[2i+1] seconds when new, allowing
# ARGV[2i+2]). Returns the grant, each window's count and time to live, and Redis's clock.
RESERVE_WINDOWS = b"""
local grant = tonumber(ARGV[1])
local sharers = tonumber(ARGV[2])
local counts = {}
for i, key in ipairs(KEYS) do
    counts[i] = tonumber(redis.call("get", key) or "0")
    local left = tonumber(ARGV[2 * i + 2]) - counts[i]
    grant = math.min(grant, math.max(math.floor(left / sharers), math.min(left, 1)))
end
grant = math.max(grant, 0)
local counted = {grant}
for i, key in ipairs(KEYS) do
    local ttl = redis.call("pttl", key)
    if grant > 0 then
        counts[i] = redis.call("incrby", key, grant)
        if ttl < 0 then
            redis.call("expire", key, ARGV[2 * i + 1])
            ttl = ARGV[2 * i + 1] * 1000
        end
    end
    counted[#counted + 1] = counts[i]
    counted[#counted + 1] = ttl
end
local now = redis.call("time")
counted[#counted + 1] = now[1]
counted[#counted + 1] = now[2]
return counted
"""

# Give back ARGV[1] unspent requests of a lease to each window (KEYS[i]) that is still the one
# leased from: the one ending at ARGV[i+1] (milliseconds, Redis's clock) give or take 100 ms. A
# window that ended since, and the new one after it, keep their counts. Returns how many windows
# took them back. (Effects replication: writes after TIME, on a Redis older than 5 too.)
RELEASE_WINDOWS = b"""
if redis.replicate_commands then redis.replicate_commands() end
local now = redis.call("time")
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local given = 0
for i, key in ipairs(KEYS) do
    local ttl = redis.call("pttl", key)
    if ttl > 0 and math.abs(now_ms + ttl - tonumber(ARGV[i + 1])) <= 100 then
        local count = tonumber(redis.call("get", key) or "0")
        redis.call("decrby", key, math.min(tonumber(ARGV[1]), count))
        given = given + 1
    end
end
return given
"""

# The workers that share the limits: each one's heartbeat (ARGV[1], "leave" on ARGV[3] at its
# exit) in the sorted set KEYS[1], scored by Redis's clock; beats older than ARGV[2] seconds are
# forgotten. Returns how many workers beat within them.
WORKERS = b"""
if redis.replicate_commands then redis.replicate_commands() end
local now = tonumber(redis.call("time")[1])
if ARGV[3] == "leave" then
    redis.call("zrem", KEYS[1], ARGV[1])
else
    redis.call("zadd", KEYS[1], now, ARGV[1])
end
redis.call("zremrangebyscore", KEYS[1], "-inf", now - tonumber(ARGV[2]))
redis.call("expire", KEYS[1], ARGV[2])
return redis.call("zcard", KEYS[1])
"""

# The window's time to live and Redis's clock, for the end of a window read without counting.
WINDOW_END = b"""
local now = redis.call("time")
return {redis.call("pttl", KEYS[1]), now[1], now[2]}
"""


def storage_clock(seconds: bytes | str | int, microseconds: bytes | str | int) -> float:
    """Unix seconds of Redis's TIME answer."""
    return int(seconds) + int(microseconds) / 1_000_000


# A window to count in: (storage key, seconds it lasts once started, requests it allows).
StorageWindow = tuple[str, int, int]
# A window's count after a request (or a lease), and its end on the storage's clock.
Counted = tuple[int, float]


def counts_and_ends(counted: Sequence[Any], now: float) -> list[Counted]:
    """(count, end) of each window from a script's flat (count, milliseconds to live) pairs."""
    return [
        (int(counted[i]), now + max(int(counted[i + 1]), 0) / 1000)
        for i in range(0, len(counted), 2)
    ]


class Reservation(NamedTuple):
    """What RESERVE_WINDOWS granted: requests (0: a window is spent), each window's (count, end)
    up to the spent one, and the storage's clock then."""

    granted: int
    counted: list[Counted]
    now: float


@functools.lru_cache(maxsize=4096)
def storage_windows(
    items: tuple[RateLimitItem, ...], identifiers: tuple[str, ...]
) -> list[StorageWindow]:
    """The storage's windows to count each item in, as (storage key, expiry, amount): made once
    per budget, not once per request."""
    return [(item.key_for(*identifiers), item.get_expiry(), item.amount) for item in items]


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


def storage_options(config: Mapping[str, Any]) -> dict[str, Any]:
    """Short socket timeouts for Redis, so a dead or silent Redis cannot hang a request."""
    uri = config["RATELIMIT_STORAGE_URI"]
    timeout = config["REDIS_TIMEOUT"]
    timeouts = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
    if uri.startswith(("redis://", "rediss://", "redis+cluster://")):
        return timeouts
    if uri.startswith("redis+sentinel://"):
        # The same bounds for asking the sentinels; counts are read on the master only, since
        # a replica lags behind it.
        return {**timeouts, "sentinel_kwargs": dict(timeouts), "use_replicas": False}
    return {}


class OwnConnection(threading.local):
    """A thread's own connection to Redis, and the process that made it (a forked worker makes
    its own rather than share its parent's socket)."""

    conn: AbstractConnection | None = None
    pid = 0


class CountingRedisStorage(RedisStorage):
    """redis:// whose increment also returns the window's end, in the same round trip, on Redis's
    clock: a window's X-RateLimit-Reset is the same second through every host."""

    STORAGE_SCHEME = ["petstore+redis", "petstore+rediss"]

    def __init__(self, uri: str, **options: Any) -> None:
        self.own = OwnConnection()
        super().__init__(uri.removeprefix(SCHEME_PREFIX), **options)

    def initialize_storage(self, uri: str) -> None:
        super().initialize_storage(uri)
        self.lua_incr_windows = self.get_connection().register_script(INCR_WINDOWS)
        self.lua_window_end = self.get_connection().register_script(WINDOW_END)
        self.lua_reserve_windows = self.get_connection().register_script(RESERVE_WINDOWS)
        self.lua_release_windows = self.get_connection().register_script(RELEASE_WINDOWS)
        self.lua_workers = self.get_connection().register_script(WORKERS)
        # What a Redis that lacks a script answers, from the redis package limits loaded.
        self.no_script: type[Exception] = self.dependencies["redis"].module.exceptions.NoScriptError

    def incr_windows(
        self, windows: Sequence[StorageWindow], amount: int = 1
    ) -> list[tuple[int, float]]:
        """Add `amount` to each window in turn, up to the first over its limit: (count, end) of
        each, in one call of the INCR_WINDOWS script."""
        keys, args = [], [amount]
        for key, expiry, limit in windows:
            keys.append(self.prefixed_key(key))
            args += (expiry, limit)
        *counted, seconds, microseconds = self.call(self.lua_incr_windows, keys, args)
        return counts_and_ends(counted, storage_clock(seconds, microseconds))

    def incr_with_expiry(self, key: str, expiry: int, amount: int = 1) -> tuple[int, float]:
        """Add `amount` to the key's window (started with `expiry` s when new): (count, end).
        This class's one call for one window, on a Cluster too (whose incr_windows calls this)."""
        return CountingRedisStorage.incr_windows(self, [(key, expiry, 0)], amount)[0]

    def reserve_windows(
        self, windows: Sequence[StorageWindow], most: int, sharers: int
    ) -> Reservation:
        """A lease of at most `most` requests in every window, in one call of RESERVE_WINDOWS."""
        keys, args = [], [most, sharers]
        for key, expiry, limit in windows:
            keys.append(self.prefixed_key(key))
            args += (expiry, limit)
        granted, *counted, seconds, microseconds = self.call(self.lua_reserve_windows, keys, args)
        now = storage_clock(seconds, microseconds)
        return Reservation(int(granted), counts_and_ends(counted, now), now)

    def release_windows(
        self, windows: Sequence[StorageWindow], unspent: int, ends: Sequence[float]
    ) -> None:
        """Give `unspent` requests back to each window that still ends at its `ends` (RELEASE_WINDOWS)."""
        keys = [self.prefixed_key(key) for key, _expiry, _limit in windows]
        self.call(self.lua_release_windows, keys, [unspent, *(round(end * 1000) for end in ends)])

    def workers(self, key: str, member: str, horizon: int, leave: bool = False) -> int:
        """Note this worker's heartbeat (or its leaving) in `key`; how many workers beat within
        `horizon` seconds (WORKERS)."""
        args = [member, horizon, "leave" if leave else "beat"]
        return int(self.call(self.lua_workers, [self.prefixed_key(key)], args))

    def get_expiry(self, key: str) -> float:
        """The end of the key's window on Redis's clock (now, if it has none), in one round trip."""
        ttl, seconds, microseconds = self.call(self.lua_window_end, [self.prefixed_key(key)], [])
        return storage_clock(seconds, microseconds) + max(int(ttl), 0) / 1000

    def incr(self, key: str, expiry: int, amount: int = 1) -> int:
        return self.incr_with_expiry(key, expiry, amount)[0]

    def call(self, script: Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run `script` on this thread's own connection (loading it first on a Redis that lacks
        it); a failure closes the connection and raises."""
        own, pid = self.own, os.getpid()
        if own.conn is None or own.pid != pid:
            pool = self.storage.connection_pool
            own.conn, own.pid = pool.connection_class(**pool.connection_kwargs), pid
        conn = own.conn
        try:
            # Connects when not connected, to the master Sentinel names now for redis+sentinel
            # (send_command alone would connect to the connection's default address).
            conn.connect()
            try:
                conn.send_command("EVALSHA", script.sha, len(keys), *keys, *args)
                return conn.read_response()
            except self.no_script:  # a new Redis, or one restarted empty
                conn.send_command("SCRIPT", "LOAD", script.script)
                conn.read_response()
                conn.send_command("EVALSHA", script.sha, len(keys), *keys, *args)
                return conn.read_response()
        except BaseException:
            conn.disconnect()
            raise


class WindowByWindow:
    """incr_windows one window at a time, with the storage's own `incr_with_expiry` (memory://,
    and a Cluster, where a budget's windows may live in different slots)."""

    incr_with_expiry: Any

    def incr_windows(self, windows: Sequence[StorageWindow], amount: int = 1) -> list[Counted]:
        """Add `amount` to each window in turn, up to the first over its limit: (count, end) of each."""
        counted = []
        for key, expiry, limit in windows:
            count, end = self.incr_with_expiry(key, expiry, amount)
            counted.append((count, end))
            if count > limit:
                break
        return counted


class SweepingMemoryStorage(WindowByWindow, MemoryStorage):
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


class CountingClusterStorage(WindowByWindow, CountingRedisStorage, RedisClusterStorage):
    """redis+cluster://: the same count and expiry in one call per window, since the windows'
    keys may live in different slots (one script call touches one slot)."""

    STORAGE_SCHEME = ["petstore+redis+cluster"]

    def call(self, script: Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run `script` through the cluster client, which finds the node of the keys' slot."""
        return script(keys, args)

    def reserve_windows(
        self, windows: Sequence[StorageWindow], most: int, sharers: int
    ) -> Reservation:
        """A lease window by window (one slot per call): each window grants at most what the one
        before it did, and the earlier windows get back what a later one did not grant."""
        counted: list[Counted] = []
        granted, now = most, 0.0
        for at, window in enumerate(windows):
            reserved = super().reserve_windows([window], granted, sharers)
            counted += reserved.counted
            now = reserved.now
            if reserved.granted < granted:
                ends = [end for _count, end in counted[:at]]
                self.release_windows(windows[:at], granted - reserved.granted, ends)
                granted = reserved.granted
            if not granted:
                break
        return Reservation(granted, counted, now)

    def release_windows(
        self, windows: Sequence[StorageWindow], unspent: int, ends: Sequence[float]
    ) -> None:
        """Give `unspent` requests back window by window (one slot per call)."""
        for window, end in zip(windows, ends, strict=True):
            super().release_windows([window], unspent, [end])
