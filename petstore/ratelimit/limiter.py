"""The flask-limiter adapter: flask-limiter stays the limiter (its storage, strategy and in-memory
fallback, from the RATELIMIT_* settings), but the request pipeline drives it: one count per
request, by `PlanLimiter.count`, instead of flask-limiter's own hooks. Its per-request limit
resolution, exemption scopes and header reads cost about as much CPU as the rest of a request, for
features this service does not use (decorated, per-route and meta limits).

Internals of flask-limiter used here (re-check them on every upgrade; tests/app/test_overrides.py
fails loudly when one of them is gone or has changed shape):

- `Limiter._check_request_limit`, its after-request header hook and its teardown hook are
  detached from the app: the pipeline counts (petstore.ratelimit.budgets.count) and sets the
  headers;
- `Limiter._storage_dead`, `_limiter`, `_fallback_limiter`, `_in_memory_fallback_enabled`:
  the switch to the in-memory fallback when the storage fails, and back when it answers.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from typing import Any

from flask import Flask
from flask_limiter import Limiter
from limits import RateLimitItem
from limits.strategies import FixedWindowRateLimiter, RateLimiter

from petstore.ratelimit.leases import Leases, Result, counted
from petstore.ratelimit.storages import storage_windows

log = logging.getLogger(__name__)

# While the storage is down, ask it at most this often whether it answers again.
STORAGE_RECHECK_SECONDS = 1.0


class PlanLimiter(Limiter):
    """flask-limiter with no hooks of its own: the pipeline counts each request once through `count`."""

    next_storage_check = 0.0
    # A hot key's leases (petstore.ratelimit.leases), on Redis with the fixed window.
    leases: Leases | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Held to switch to the fallback or back: each switch is made, and logged, once.
        self.switching = threading.Lock()

    @staticmethod
    def on_fallback() -> None:
        """Called once when a failing storage sends the counts to the in-memory fallback."""

    def init_app(self, app: Flask) -> None:
        super().init_app(app)
        detach_hooks(app, self)

    def lease_hot_keys(self, hot_rate: int, idle_seconds: float, workers_key: str) -> None:
        """Count hot keys from leases (petstore.ratelimit.leases), where the storage can lease:
        Redis, with the fixed window."""
        if (
            hot_rate
            and type(self.limiter) is FixedWindowRateLimiter
            and hasattr(self.storage, "reserve_windows")
        ):
            self.leases = Leases(self.storage, hot_rate, idle_seconds, workers_key)

    def count(self, items: tuple[RateLimitItem, ...], *identifiers: str) -> list[Result]:
        """Count one request against each of `items` in turn, up to the first one it exceeds:
        (within the limit, remaining, reset time) of each.

        The fixed window, the default strategy, is counted in one call of our storages
        (petstore.ratelimit.storages: one round trip on Redis), or from a hot key's lease
        (petstore.ratelimit.leases); the other strategies through their `hit` and
        `get_window_stats`. A storage that fails sends this and every later count to the
        in-memory fallback, until the storage answers its check again (at most one check per
        STORAGE_RECHECK_SECONDS). There each worker counts its share of every limit: the limit
        divided by the workers its leases know share it.
        """
        if self._storage_dead:
            self.recheck_storage()
        try:
            if self._storage_dead:
                return self.count_in_fallback(items, identifiers)
            if self.leases is not None:
                return self.leases.count(items, identifiers)
            return count_windows(self.limiter, items, identifiers)
        except Exception:
            if not self._in_memory_fallback_enabled:
                raise
            with self.switching:  # one switch, one line, however many threads fail at once
                if not self._storage_dead:
                    self._storage_dead = True
                    self.next_storage_check = time.monotonic() + STORAGE_RECHECK_SECONDS
                    log.warning(
                        "Rate limit storage unreachable - falling back to in-memory storage"
                    )
                    self.on_fallback()
            return self.count_in_fallback(items, identifiers)

    def count_in_fallback(
        self, items: tuple[RateLimitItem, ...], identifiers: tuple[str, ...]
    ) -> list[Result]:
        """count, in memory while the storage is down: this worker's share of each limit."""
        sharers = 1 if self.leases is None else self.leases.sharers
        fallback = self._fallback_limiter
        assert fallback is not None
        return count_windows(fallback, shares(items, sharers), identifiers)

    def refusing(self, items: tuple[RateLimitItem, ...], *identifiers: str) -> bool:
        """Whether a hot key's requests are refused in this worker until its window ends (its
        strikes are then counted in batches)."""
        return self.leases is not None and self.leases.refusing(items, identifiers)

    @property
    def storage_dead(self) -> bool:
        """Whether counts go to the in-memory fallback because the storage failed."""
        return bool(self._storage_dead)

    def recheck_storage(self) -> None:
        """Go back to the storage once it answers again: one thread asks, the others count on."""
        now = time.monotonic()
        if now < self.next_storage_check or not self.switching.acquire(blocking=False):
            return
        try:
            if not self._storage_dead or now < self.next_storage_check:
                return
            self.next_storage_check = now + STORAGE_RECHECK_SECONDS
            try:
                alive = self.storage.check()
            except Exception:
                alive = False
            if alive:
                self._storage_dead = False
                log.info("Rate limit storage recovered")
        finally:
            self.switching.release()


@functools.lru_cache(maxsize=4096)
def shares(items: tuple[RateLimitItem, ...], sharers: int) -> tuple[RateLimitItem, ...]:
    """Each item's share among `sharers` workers (rounded up): what one worker may admit alone."""
    if sharers <= 1:
        return items
    return tuple(
        type(item)(math.ceil(item.amount / sharers), item.multiples, item.namespace)
        for item in items
    )


def count_windows(
    strategy: RateLimiter, items: tuple[RateLimitItem, ...], identifiers: tuple[str, ...]
) -> list[Result]:
    """(within the limit, remaining, reset time) of each item counted with `strategy`, up to
    the first one the request exceeds."""
    incr_windows = getattr(strategy.storage, "incr_windows", None)
    if type(strategy) is FixedWindowRateLimiter and incr_windows is not None:
        return counted(items, incr_windows(storage_windows(items, identifiers)))
    results: list[Result] = []
    for item in items:
        allowed = strategy.hit(item, *identifiers)
        reset, remaining = strategy.get_window_stats(item, *identifiers)
        results.append((allowed, remaining, reset))
        if not allowed:
            break
    return results


def detach_hooks(app: Flask, limiter: Limiter) -> None:
    """Remove the request hooks that flask-limiter's init_app registered on `app`."""

    def ours(hook: Any) -> bool:
        bound_to = getattr(hook, "__self__", None)
        if isinstance(hook, functools.partial):
            bound_to = hook.args[0] if hook.args else None
        return bound_to is limiter

    registries: tuple[Any, ...] = (
        app.before_request_funcs,
        app.after_request_funcs,
        app.teardown_request_funcs,
    )
    for hooks in registries:
        for name, functions in hooks.items():
            hooks[name] = [hook for hook in functions if not ours(hook)]
