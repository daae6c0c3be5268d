"""Plan-keyed rate limits (flask-limiter), strikes and bans, and the X-RateLimit-* header policy."""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from typing import Any

from flask import Flask, Response, current_app, g, request
from flask_limiter import Limiter, RequestLimit
from flask_limiter.errors import RateLimitExceeded

from petstore import db, storages
from petstore.config import ConfigError
from petstore.errors import APIError, error_response
from petstore.queries import bans
from petstore.web import in_api

log = logging.getLogger(__name__)

# Requests per minute and per day of each plan (the spec's Limits table).
# Enterprise numbers are stored on each key; other plans may override theirs there.
PLAN_LIMITS: dict[str, tuple[int, int]] = {
    "free": (60, 1_000),
    "pro": (300, 10_000),
    "business": (1_000, 100_000),
}


def rate_limit_key() -> str:
    """Whose budget a request spends: the key's id (never the secret), else the client IP."""
    caller = g.get("caller")
    if caller is not None:
        return f"key:{caller['id']}"
    return f"ip:{request.remote_addr}"


def caller_limits() -> str:
    """The limit string of the caller: its plan's or its own numbers, or the per-IP numbers."""
    caller = g.get("caller")
    if caller is None:
        ip_limits: str = current_app.config["IP_LIMITS"]
        return ip_limits
    per_minute, per_day = PLAN_LIMITS.get(caller["plan"], (0, 0))
    return f"{caller['per_minute'] or per_minute}/minute;{caller['per_day'] or per_day}/day"


def exempt() -> bool:
    """Requests that spend no budget: outside /v1, and from banned keys (refused before counting)."""
    caller = g.get("caller")
    return not in_api() or (caller is not None and caller["banned_until"] is not None)


def refuse_banned() -> None:
    """A banned key gets 429 api_key_banned until its ban ends."""
    caller = g.get("caller")
    if caller is None or caller["banned_until"] is None:
        return
    until = caller["banned_until"].timestamp()
    g.rate_limit_headers = (caller_limit_amount(caller), 0, math.ceil(until))
    raise APIError(
        429,
        f"This API key is banned until {caller['banned_until'].isoformat(timespec='seconds')} "
        "for continuing to call after 429 responses.",
        "api_key_banned",
        headers={"Retry-After": str(seconds_until(until))},
    )


def caller_limit_amount(caller: dict[str, Any]) -> int:
    """The per-minute number of a key, shown as X-RateLimit-Limit while it is banned."""
    return int(caller["per_minute"] or PLAN_LIMITS.get(caller["plan"], (0, 0))[0])


def seconds_until(instant: float) -> int:
    """Whole seconds from now until `instant`, at least 1 (a Retry-After value)."""
    return max(1, math.ceil(instant - time.time()))


class FallbackLimiter(Limiter):
    """flask-limiter where every request that meets a failing storage falls back, not only the first.

    flask-limiter switches to its in-memory fallback in the request that finds the storage down;
    another thread's request that was counting in the storage at that moment re-raised the error
    (a 500). It counts in the fallback too.
    """

    def _check_request_limit(
        self, callable_name: str | None = None, in_middleware: bool = True
    ) -> None:
        was_dead = self._storage_dead
        try:
            super()._check_request_limit(callable_name, in_middleware)
        except RateLimitExceeded:
            raise
        except Exception:
            if was_dead or not self._storage_dead:
                raise
            self.context.seen_limits.clear()
            super()._check_request_limit(callable_name, in_middleware)


def get_limiter() -> Limiter:
    """The limiter of the current app."""
    limiter: Limiter = current_app.extensions["petstore.limiter"]
    return limiter


def handle_rate_limited(error: RateLimitExceeded) -> Response:
    """429 for a spent budget: count a strike, and ban a key that keeps going."""
    limiter = get_limiter()
    breached = limiter.current_limit
    assert breached is not None
    reset = breached.window.reset_time
    headers = {"Retry-After": str(seconds_until(reset))}
    caller = g.get("caller")
    if caller is not None:
        try:
            strike(limiter, caller, breached)
        except Exception:
            # The 429 stands even when the strike cannot be counted or the ban stored.
            log.exception("cannot count a strike against key %s", caller["id"])
    return error_response(
        429,
        "rate_limited",
        f"Rate limit exceeded: {breached.limit.amount} per {breached.limit.GRANULARITY.name}.",
        headers,
    )


def strike(limiter: Limiter, caller: dict[str, Any], breached: RequestLimit) -> None:
    """Count a 429 against the key in the limiter storage; at the threshold, ban it in PostgreSQL."""
    config = current_app.config
    storage = limiter.limiter.storage
    strike_key = f"{config['RATELIMIT_STRATEGY']}/strikes/{caller['id']}"
    strikes = storage.incr(strike_key, breached.limit.get_expiry())
    if strikes < config["BAN_THRESHOLD"]:
        return
    conn = db.get_conn()
    with conn.transaction():
        ban = bans.insert_ban(
            conn, key_id=caller["id"], base_seconds=config["BAN_SECONDS"], strikes=strikes
        )
    # A new ban starts a new count: after it ends, the key gets a full threshold again.
    storage.clear(strike_key)
    if ban is not None:
        log.warning(
            "banned key %s for %s s after %s strikes", caller["id"], ban["seconds"], strikes
        )


def set_headers(response: Response) -> Response:
    """X-RateLimit-* on every /v1 response: the breached limit on 429, else the one nearest to running out."""
    if not in_api():  # only the API is limited; /healthz and /readyz are not
        return response
    numbers = g.get("rate_limit_headers")
    if numbers is None:
        numbers = limit_in_force(get_limiter())
    if numbers is not None:
        limit, remaining, reset = numbers
        response.headers["X-RateLimit-Limit"] = str(limit)
        response.headers["X-RateLimit-Remaining"] = str(remaining)
        response.headers["X-RateLimit-Reset"] = str(reset)
    return response


def limit_in_force(limiter: Limiter) -> tuple[int, int, int] | None:
    """(limit, remaining, reset) of the limit to show, or None if nothing was counted."""
    evaluated = limiter.current_limits
    if not evaluated:
        return None
    try:
        breached = [each for each in evaluated if each.breached]
        shown = breached[0] if breached else min(evaluated, key=lambda each: each.remaining)
        return shown.limit.amount, shown.remaining, math.ceil(shown.window.reset_time)
    except Exception:
        # The storage failed between counting and reporting: answer without the headers.
        log.exception("cannot read the rate limit window")
        return None


def refuse_shared_memory_storage(app: Flask) -> None:
    """memory:// counts per process: refuse to run in a second worker of the same gunicorn master.

    Each worker binds an abstract unix socket named after its master's pid; a second
    worker finds the name taken. The kernel frees it when the worker dies, so a
    replacement worker starts fine.
    """
    if not app.config["RATELIMIT_STORAGE_URI"].startswith("memory://"):
        return
    if not os.environ.get("SERVER_SOFTWARE", "").startswith("gunicorn"):
        return
    guard = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        guard.bind(f"\0petstore-memory-limiter-{os.getppid()}")
    except OSError:
        guard.close()
        # Not SystemExit: gunicorn reboots a worker that exits with status 1, forever, while
        # the first worker serves; an exception during boot makes the whole server stop.
        raise ConfigError(
            "RATELIMIT_STORAGE_URI=memory:// counts in one process only, and this gunicorn runs "
            "more than one worker: every limit would be multiplied. Use --workers 1 (and "
            "--threads for concurrency) or a shared storage such as redis://."
        ) from None
    app.extensions["petstore.memory_guard"] = guard


def init_app(app: Flask) -> None:
    """Attach a limiter with one application-wide budget per key (or IP), bans and the header policy."""
    config = app.config
    refuse_shared_memory_storage(app)
    limiter = FallbackLimiter(
        rate_limit_key,
        application_limits=[caller_limits],
        strategy=config["RATELIMIT_STRATEGY"],
        storage_uri=storages.storage_uri(
            config["RATELIMIT_STORAGE_URI"], config.get("RATELIMIT_TUNED_STORAGES", True)
        ),
        storage_options=storage_options(config),
        # Strategy in every storage key: switching strategy never reads the other's counters.
        key_prefix=config["RATELIMIT_STRATEGY"],
        # Unrouted requests (404) have no endpoint; count them too, in the same global budget.
        request_identifier=lambda: request.endpoint or "unrouted",
        headers_enabled=False,  # set_headers is the one header policy
        in_memory_fallback_enabled=True,
    )
    limiter.request_filter(exempt)
    limiter.init_app(app)
    app.extensions["petstore.limiter"] = limiter
    if limiter.enabled and isinstance(limiter.storage, storages.CountingRedisStorage):
        app.teardown_request(limiter.storage.forget)
    app.before_request(refuse_banned)
    app.after_request(set_headers)
    app.register_error_handler(RateLimitExceeded, handle_rate_limited)


def storage_options(config: dict[str, Any]) -> dict[str, Any]:
    """Short socket timeouts for redis://, so a dead or silent Redis cannot hang a request."""
    if config["RATELIMIT_STORAGE_URI"].startswith(("redis://", "rediss://")):
        timeout = config["REDIS_TIMEOUT"]
        return {"socket_timeout": timeout, "socket_connect_timeout": timeout}
    return {}
