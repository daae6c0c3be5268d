"""Rate limiting, in one package: each request counted once against its key's plan (or its
client address's limits), strikes and bans for keys that call on after 429, and the headers.

- budgets.py: counting, the X-RateLimit-* and RateLimit-Policy/RateLimit fields, a key's
  standing for GET /v1/rate_limit;
- bans.py: strikes after 429s (a hot key's in batches), bans in PostgreSQL, 429
  api_key_banned, clearing strikes;
- limiter.py: the flask-limiter adapter (`PlanLimiter`), which the pipeline drives;
- leases.py: a hot key counted from leases of its budget, and the workers that share it;
- storages.py: the limiter's storages (fewer round trips) and their options;
- here: set-up, `init_app`, with the guard against memory:// in several workers.
"""

from __future__ import annotations

import os
import socket

from flask import Flask
from flask_limiter.util import get_remote_address
from limits import parse_many

from petstore import metrics
from petstore.config import ConfigError
from petstore.ratelimit import storages
from petstore.ratelimit.bans import Tallies
from petstore.ratelimit.budgets import AnonymousClients
from petstore.ratelimit.limiter import PlanLimiter
from petstore.ratelimit.storages import storage_options


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
    """Attach the limiter: flask-limiter's storage, strategy and in-memory fallback."""
    config = app.config
    refuse_shared_memory_storage(app)
    limiter = PlanLimiter(
        # Unused: the pipeline says whose budget a request spends (count).
        get_remote_address,
        storage_uri=storages.storage_uri(
            config["RATELIMIT_STORAGE_URI"], config["RATELIMIT_TUNED_STORAGES"]
        ),
        storage_options=storage_options(config),
        strategy=config["RATELIMIT_STRATEGY"],
        in_memory_fallback_enabled=True,
    )
    limiter.init_app(app)
    limiter.lease_hot_keys(
        config["RATELIMIT_HOT_RATE"],
        config["LEASE_IDLE_SECONDS"],
        f"{config['RATELIMIT_STRATEGY']}/workers",
    )
    limiter.on_fallback = metrics.ratelimit_storage_failed  # type: ignore[method-assign]
    app.extensions["petstore.limiter"] = limiter
    app.extensions["petstore.strike_tallies"] = Tallies()
    ip_limits = tuple(sorted(parse_many(config["IP_LIMITS"])))
    app.extensions["petstore.ip_limits"] = ip_limits
    app.extensions["petstore.anonymous_clients"] = (
        AnonymousClients(
            config["ANONYMOUS_CLIENTS"], max(limit.get_expiry() for limit in ip_limits)
        )
        if config["RATELIMIT_STORAGE_URI"].startswith("memory://")
        else None
    )
