"""Liveness and readiness: no key, no rate limit, logged at debug level only."""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable

from flask import Blueprint, Response, current_app

from petstore.auth import public
from petstore.db import get_pool
from petstore.errors import error_response
from petstore.web import json_response

bp = Blueprint("health", __name__)
log = logging.getLogger(__name__)


@bp.get("/healthz")
@public
def healthz() -> Response:
    """The process is alive and answering."""
    return json_response('{"status":"ok"}')


def postgres_answers() -> None:
    pool = get_pool()
    with pool.connection(timeout=current_app.config["READY_TIMEOUT"]) as conn:
        conn.execute("select 1")


def limiter_storage_answers() -> None:
    if not current_app.extensions["petstore.limiter"].storage.check():
        raise ConnectionError("the rate limit storage did not answer")


CHECKS: dict[str, Callable[[], None]] = {
    "postgres": postgres_answers,
    "ratelimit_storage": limiter_storage_answers,
}


@bp.get("/readyz")
@public
def readyz() -> Response:
    """PostgreSQL and the rate limit storage both answer within READY_TIMEOUT; else 503 naming them."""
    app = current_app._get_current_object()  # type: ignore[attr-defined]
    timeout = app.config["READY_TIMEOUT"]

    def run(check: Callable[[], None]) -> None:
        with app.app_context():
            check()

    failed = []
    # Both checks at once, each bounded, so that a silent server cannot hold the probe.
    with concurrent.futures.ThreadPoolExecutor(len(CHECKS)) as executor:
        futures = {name: executor.submit(run, check) for name, check in CHECKS.items()}
        for name, future in futures.items():
            try:
                future.result(timeout=timeout)
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
    return json_response('{"status":"ready","checks":{"postgres":"ok","ratelimit_storage":"ok"}}')
