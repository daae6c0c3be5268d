"""Where the service leans on a library's internals. Re-check each of these on every upgrade.

tests/app/test_overrides.py fails loudly when one of them is gone or has changed shape.

flask-limiter: it stays the limiter (its storage, strategy and in-memory fallback, from the
RATELIMIT_* settings), but the request pipeline drives it: one count per request, by
`PlanLimiter.hit`, instead of flask-limiter's own hooks. Its per-request limit resolution,
exemption scopes and header reads cost about as much CPU as the rest of a request, for
features this service does not use (decorated, per-route and meta limits). Internals used:

- `Limiter._check_request_limit`, its after-request header hook and its teardown hook are
  detached from the app: the pipeline counts (petstore.budgets.count) and sets the headers;
- `Limiter._storage_dead`, `_limiter`, `_fallback_limiter`, `_in_memory_fallback_enabled`:
  the switch to the in-memory fallback when the storage fails, and back when it answers.

The limiter storages (petstore.storages) subclass the `limits` storages.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

from flask import Flask
from flask_limiter import Limiter
from limits import RateLimitItem
from limits.strategies import RateLimiter
from limits.util import WindowStats

log = logging.getLogger(__name__)

# While the storage is down, ask it at most this often whether it answers again.
STORAGE_RECHECK_SECONDS = 1.0


class PlanLimiter(Limiter):
    """flask-limiter with no hooks of its own: the pipeline counts each request once through `hit`."""

    next_storage_check = 0.0

    def init_app(self, app: Flask) -> None:
        super().init_app(app)
        detach_hooks(app, self)

    def hit(self, item: RateLimitItem, *identifiers: str) -> bool:
        """Count one request against `item`; False when that spends more than it allows.

        A storage that fails sends this and every later count to the in-memory fallback, until
        the storage answers its check again (at most one check per STORAGE_RECHECK_SECONDS).
        """
        if self._storage_dead:
            self.recheck_storage()
        try:
            return self.limiter.hit(item, *identifiers)
        except Exception:
            if not self._in_memory_fallback_enabled:
                raise
            if not self._storage_dead:
                log.warning("Rate limit storage unreachable - falling back to in-memory storage")
                self._storage_dead = True
                self.next_storage_check = time.monotonic() + STORAGE_RECHECK_SECONDS
            return self.fallback.hit(item, *identifiers)

    def window(self, item: RateLimitItem, *identifiers: str) -> WindowStats | None:
        """(reset time, remaining) of `item` after this request's count; None if unreadable."""
        try:
            return self.limiter.get_window_stats(item, *identifiers)
        except Exception:
            log.exception("cannot read the rate limit window")
            return None

    def forget_counts(self) -> None:
        """Let the storage drop what it remembered of this thread's last request (redis://)."""
        forget = getattr(self.storage, "forget", None)
        if forget is not None:
            forget()

    @property
    def fallback(self) -> RateLimiter:
        """The in-memory strategy counted in while the storage is down."""
        fallback = self._fallback_limiter
        assert fallback is not None
        return fallback

    @property
    def storage_dead(self) -> bool:
        """Whether counts go to the in-memory fallback because the storage failed."""
        return bool(self._storage_dead)

    def recheck_storage(self) -> None:
        """Go back to the storage once it answers again."""
        now = time.monotonic()
        if now < self.next_storage_check:
            return
        self.next_storage_check = now + STORAGE_RECHECK_SECONDS
        try:
            alive = self.storage.check()
        except Exception:
            alive = False
        if alive:
            log.info("Rate limit storage recovered")
            self._storage_dead = False


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
