"""Every use of a library's internals, in one module. Re-check each of these on every upgrade.

tests/app/test_overrides.py fails loudly when one of them is gone or has changed shape.

flask-limiter: it stays the limiter (its storage, strategy and in-memory fallback, from the
RATELIMIT_* settings), but the request pipeline drives it: one count per request, by
`PlanLimiter.count`, instead of flask-limiter's own hooks. Its per-request limit resolution,
exemption scopes and header reads cost about as much CPU as the rest of a request, for
features this service does not use (decorated, per-route and meta limits). Internals used:

- `Limiter._check_request_limit`, its after-request header hook and its teardown hook are
  detached from the app: the pipeline counts (petstore.budgets.count) and sets the headers;
- `Limiter._storage_dead`, `_limiter`, `_fallback_limiter`, `_in_memory_fallback_enabled`:
  the switch to the in-memory fallback when the storage fails, and back when it answers.

gunicorn: when it cannot parse a request (a request line, a header, a chunked body it refuses),
its worker's ``handle_error`` answers through ``gunicorn.util.write_error``, which writes an HTML
page. ``use_json_refusals()`` puts ``write_error_json`` in its place, so those refusals are the
Error JSON like every other answer, whatever the worker class. deploy/gunicorn.conf.py calls it.

gunicorn's logger: given a logging configuration (logconfig_dict), gunicorn builds the fields
of its access log line for every request even when no access log is wanted, then drops the
line. `NoAccessLogger` (deploy/gunicorn.conf.py's logger_class) skips it: the app writes its
own line (petstore.logs).

The limiter storages (petstore.storages) subclass the `limits` storages.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import threading
import time
import uuid
from http import HTTPStatus
from typing import Any

import gunicorn.glogging
import gunicorn.util
import gunicorn.workers.base
from flask import Flask
from flask_limiter import Limiter
from limits import RateLimitItem
from limits.strategies import FixedWindowRateLimiter, RateLimiter

from petstore.storages import Window

log = logging.getLogger(__name__)

# While the storage is down, ask it at most this often whether it answers again.
STORAGE_RECHECK_SECONDS = 1.0


class PlanLimiter(Limiter):
    """flask-limiter with no hooks of its own: the pipeline counts each request once through `count`."""

    next_storage_check = 0.0

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

    def count(
        self, items: tuple[RateLimitItem, ...], *identifiers: str
    ) -> list[tuple[bool, int, float]]:
        """Count one request against each of `items` in turn, up to the first one it exceeds:
        (within the limit, remaining, reset time) of each.

        The fixed window, the default strategy, is counted in one call of our storages
        (petstore.storages: one round trip on Redis); the other strategies through their `hit`
        and `get_window_stats`. A storage that fails sends this and every later count to the
        in-memory fallback, until the storage answers its check again (at most one check per
        STORAGE_RECHECK_SECONDS).
        """
        if self._storage_dead:
            self.recheck_storage()
        try:
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
            return count_windows(self.fallback, items, identifiers)

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
def windows_of(items: tuple[RateLimitItem, ...], identifiers: tuple[str, ...]) -> list[Window]:
    """(storage key, expiry, amount) of each item: made once per budget, not once per request."""
    return [(item.key_for(*identifiers), item.get_expiry(), item.amount) for item in items]


def count_windows(
    strategy: RateLimiter, items: tuple[RateLimitItem, ...], identifiers: tuple[str, ...]
) -> list[tuple[bool, int, float]]:
    """(within the limit, remaining, reset time) of each item counted with `strategy`, up to
    the first one the request exceeds."""
    incr_windows = getattr(strategy.storage, "incr_windows", None)
    if type(strategy) is FixedWindowRateLimiter and incr_windows is not None:
        counted = incr_windows(windows_of(items, identifiers))
        return [
            (count <= item.amount, max(0, item.amount - count), reset)
            for item, (count, reset) in zip(items, counted, strict=False)
        ]
    results = []
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


# What gunicorn refuses with (Worker.handle_error) -> what the client gets: the same codes and
# messages as nginx's own refusals (deploy/nginx/petstore.conf), so both layers answer alike.
# 501 is gunicorn's answer to an unknown Transfer-Encoding: the client's mistake, never a 5xx.
REFUSALS: dict[int, tuple[int, str, str]] = {
    400: (400, "invalid_request", "The request is malformed."),
    403: (403, "forbidden", "The request is forbidden."),
    414: (414, "uri_too_long", "The request URI is longer than the service accepts."),
    417: (417, "expectation_failed", "The service meets no expectation but 100-continue."),
    431: (
        431,
        "headers_too_large",
        "The request has more header fields, or longer ones, than the service accepts.",
    ),
    500: (500, "internal_error", "The service failed to handle the request."),
    501: (400, "invalid_request", "The Transfer-Encoding of the request is not supported."),
}

# gunicorn's own function, and the signature ours must keep: handle_error calls it positionally.
GUNICORN_WRITE_ERROR = gunicorn.util.write_error
WRITE_ERROR_PARAMETERS = ["sock", "status_int", "reason", "mesg"]
WRITE_ERROR_CALL = "util.write_error(client, status_int, reason, mesg)"


class InternalsChanged(RuntimeError):
    """The library no longer looks the way an override here relies on: stop, do not guess."""


def refusal(status_int: int) -> tuple[int, str, str]:
    """(status, code, message) the client gets for a refusal gunicorn makes with `status_int`."""
    if status_int in REFUSALS:
        return REFUSALS[status_int]
    if 400 <= status_int < 500:
        return status_int, "invalid_request", "The request is malformed."
    return REFUSALS[500]


def error_bytes(status_int: int) -> bytes:
    """A whole HTTP/1.1 answer with the Error JSON: what write_error_json sends."""
    status, code, message = refusal(status_int)
    body = json.dumps({"code": code, "message": message, "status": status}).encode()
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
        "Connection: close\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        # Like nginx's $request_id: no request was parsed to carry the client's own.
        f"X-Request-ID: {uuid.uuid4().hex}\r\n"
        "\r\n"
    )
    return head.encode("latin-1") + body


def write_error_json(sock: Any, status_int: int, reason: str, mesg: str) -> None:
    """gunicorn.util.write_error with the Error JSON for a body; `reason` and `mesg` are not sent.

    gunicorn's message quotes the client's bytes back; its own log line keeps it
    ("Invalid request from ip=...").
    """
    gunicorn.util.write_nonblock(sock, error_bytes(status_int))


def check_gunicorn() -> None:
    """Raise InternalsChanged unless gunicorn still answers refusals through util.write_error."""
    parameters = list(inspect.signature(GUNICORN_WRITE_ERROR).parameters)
    if parameters != WRITE_ERROR_PARAMETERS:
        raise InternalsChanged(
            f"gunicorn.util.write_error takes {parameters}, not {WRITE_ERROR_PARAMETERS}: "
            "review petstore/overrides.py against this gunicorn"
        )
    source = inspect.getsource(gunicorn.workers.base.Worker.handle_error)
    if WRITE_ERROR_CALL not in source:
        raise InternalsChanged(
            f"gunicorn's Worker.handle_error no longer calls {WRITE_ERROR_CALL}: "
            "review petstore/overrides.py against this gunicorn"
        )


def use_json_refusals() -> None:
    """Make gunicorn write the Error JSON where it wrote its HTML error page; idempotent.

    Called in the master (deploy/gunicorn.conf.py) before the workers fork, so every worker,
    of any worker class, inherits it.
    """
    check_gunicorn()
    gunicorn.util.write_error = write_error_json


class NoAccessLogger(gunicorn.glogging.Logger):  # type: ignore[misc]
    """gunicorn's logger with no access log: the app logs each request itself (petstore.logs).

    gunicorn's `access` builds a dict of about thirty fields for every request whenever
    logconfig_dict is set, accesslog or not, and hands it to a logger that drops it: about 15
    µs of CPU per request. Its error log (gunicorn.error) is untouched.
    """

    def access(self, resp: Any, req: Any, environ: Any, request_time: Any) -> None:
        """Nothing: no access line is wanted from gunicorn."""
