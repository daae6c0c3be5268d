"""Liveness and readiness: no key, no rate limit, logged at debug level only."""

from __future__ import annotations

import concurrent.futures
import json
import logging
from collections.abc import Callable
from importlib import metadata

from flask import Blueprint, Response, current_app

from petstore import migrations
from petstore.auth import public
from petstore.db import get_pool
from petstore.errors import error_response
from petstore.web import json_response

bp = Blueprint("health", __name__)
log = logging.getLogger(__name__)

VERSION = metadata.version("petstore")


@bp.get("/healthz")
@public
def healthz() -> Response:
    """The process is alive and answering: which version of the code it runs, and `warnings`
    naming what it serves without (an unpinned statement timeout), for the operator, never a
    reason to take it out of service."""
    body: dict[str, object] = {"status": "ok", "version": VERSION}
    pin = current_app.extensions.get("petstore.timeout_pin")
    warning = None if pin is None else pin.warning()
    if warning is not None:
        body["warnings"] = [warning]
    return json_response(json.dumps(body, separators=(",", ":")))


def postgres_answers() -> str | None:
    """PostgreSQL answers; its schema (the newest migration applied)."""
    pool = get_pool()
    with pool.connection(timeout=current_app.config["READY_TIMEOUT"]) as conn:
        return migrations.schema_version(conn)


def limiter_storage_answers() -> None:
    """The rate limit storage answers."""
    if not current_app.extensions["petstore.limiter"].storage.check():
        raise ConnectionError("the rate limit storage did not answer")


# Each check raises when its service does not answer; what it returns is reported (the schema).
CHECKS: dict[str, Callable[[], str | None]] = {
    "postgres": postgres_answers,
    "ratelimit_storage": limiter_storage_answers,
}


@bp.get("/readyz")
@public
def readyz() -> Response:
    """PostgreSQL and the rate limit storage both answer within READY_TIMEOUT; else 503 naming them."""
    app = current_app._get_current_object()  # type: ignore[attr-defined]
    timeout = app.config["READY_TIMEOUT"]

    def run(check: Callable[[], str | None]) -> str | None:
        with app.app_context():
            return check()

    failed = []
    reported: dict[str, str | None] = {}
    # Both checks at once, each bounded, so that a silent server cannot hold the probe.
    with concurrent.futures.ThreadPoolExecutor(len(CHECKS)) as executor:
        futures = {name: executor.submit(run, check) for name, check in CHECKS.items()}
        for name, future in futures.items():
            try:
                reported[name] = future.result(timeout=timeout)
            except Exception as exc:
                log.warning("not ready: %s: %s", name, exc)
                failed.append(name)
    if failed:
        return error_response(
            503,
            "service_unavailable",
            f"Not ready: {', '.join(failed)} did not answer within {timeout} s.",
            {"Retry-After": str(app.config["RETRY_AFTER"])},
        )
    ready = {
        "status": "ready",
        "version": VERSION,
        "schema": reported["postgres"],
        "checks": {"postgres": "ok", "ratelimit_storage": "ok"},
    }
    return json_response(json.dumps(ready, separators=(",", ":")))
