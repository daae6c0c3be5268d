"""The callers (petstore.caller) of recently seen keys, kept in each worker for
KEY_CACHE_SECONDS: a request whose key is held makes one database round trip (its own query),
not two.

What it promises (docs/cli.rst, "The key cache"): a change to a key in the database (revocation, a
rotation's grace cut short, scopes, plan, numbers, a ban or its lift) is seen by every worker
of every instance at most KEY_CACHE_SECONDS after it commits, because an entry is never used
longer than that after the query that fetched it started. What time alone changes is exact:
the expiry, the end of a previous secret's grace and the end of a ban are kept as instants and
compared with the clock on every request. Only keys the database found are held (an unknown
key is asked about every time and never displaces a known one), at most KEY_CACHE_SIZE of
them, the least recently fetched going first.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from flask import current_app

from petstore import tracing
from petstore.caller import Caller, caller_at, next_change

# Where auth.init_app keeps each app's (so each worker's) cache.
EXTENSION = "petstore.key_cache"

# What find_key_by_hash answers for the hash of a token: the key's row, or None.
Find = Callable[[bytes], dict[str, Any] | None]


class Entry:
    """One key's row, as found and as its caller stands until `changes_at`."""

    __slots__ = ("changes_at", "caller", "found", "fresh_until")

    def __init__(
        self, found: dict[str, Any], caller: Caller, fresh_until: float, now: float
    ) -> None:
        self.found = found
        self.caller = caller
        self.fresh_until = fresh_until  # on the cache's clock
        self.changes_at = next_change(found, now)  # unix seconds


class KeyCache:
    """Callers by their secret's hash, each used for `seconds` after its query started, at most
    `size` of them. Thread-safe: gthread workers share one per process."""

    def __init__(
        self, seconds: float, size: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.seconds = seconds
        self.size = size
        self.clock = clock  # monotonic: a step of the wall clock neither keeps nor drops entries
        self.entries: dict[bytes, Entry] = {}
        self.lock = threading.Lock()
        # Bumped by forget(): a row fetched before it is not stored after it.
        self.generation = 0

    def caller(self, key_hash: bytes, find: Find) -> Caller | None:
        """The caller whose secret has this hash, or None: from the cache while fresh, else
        from `find` (whose errors propagate: nothing stale stands in for the database)."""
        entry = self.entries.get(key_hash)
        if entry is not None and self.clock() < entry.fresh_until:
            tracing.annotate("petstore.key_cache", "hit")
            now = time.time()
            if now < entry.changes_at:
                return entry.caller
            return caller_at(entry.found, key_hash, now)
        tracing.annotate("petstore.key_cache", "miss")
        generation = self.generation
        started = self.clock()
        found = find(key_hash)
        now = time.time()
        caller = None if found is None else caller_at(found, key_hash, now)
        if found is None or caller is None:
            if entry is not None:
                with self.lock:
                    self.entries.pop(key_hash, None)
            return None
        if self.seconds > 0:
            self.store(key_hash, Entry(found, caller, started + self.seconds, now), generation)
        return caller

    def reread(self, key_hash: bytes, find: Find) -> Caller | None:
        """The caller read again with `find`, and held afresh: for a decision that must not rest
        on a row another worker or instance may have changed since."""
        with self.lock:
            self.entries.pop(key_hash, None)
        return self.caller(key_hash, find)

    def store(self, key_hash: bytes, entry: Entry, generation: int) -> None:
        """Hold `entry`, unless forget() ran since its row was fetched; evict the oldest past `size`."""
        with self.lock:
            if generation != self.generation:
                return
            # Re-inserted at the end: the dict's order is the order of fetching.
            self.entries.pop(key_hash, None)
            while len(self.entries) >= self.size:
                del self.entries[next(iter(self.entries))]
            self.entries[key_hash] = entry

    def forget(self, key_id: int) -> None:
        """Drop the key `key_id` (under any of its secrets): this worker changed it, so its next
        request asks the database. Rare (a ban), so a scan is fine."""
        with self.lock:
            self.generation += 1
            for key_hash in [
                h for h, entry in self.entries.items() if entry.caller.key_id == key_id
            ]:
                del self.entries[key_hash]


def current() -> KeyCache:
    """The key cache of the current app: auth finds callers in it, a ban forgets one."""
    cache: KeyCache = current_app.extensions[EXTENSION]
    return cache
