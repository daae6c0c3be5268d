"""Every failure becomes the Error JSON: {"code", "message", "status"}."""

from __future__ import annotations

import logging
from typing import Any

import psycopg
import psycopg_pool
from flask import Flask, Response, current_app, json
from werkzeug.exceptions import HTTPException

from petstore import db, metrics

log = logging.getLogger(__name__)

# What psycopg raises when PostgreSQL is down, restarting, unreachable or too slow.
DATABASE_UNAVAILABLE = (psycopg.OperationalError, psycopg.InterfaceError, psycopg_pool.PoolTimeout)

# HTTP status -> Error code, for errors raised by werkzeug itself.
CODES = {
    400: "invalid_request",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    410: "gone",
    413: "payload_too_large",
    415: "unsupported_media_type",
    429: "rate_limited",
    500: "internal_error",
    501: "not_implemented",
    503: "service_unavailable",
}

MESSAGES = {
    404: "No such resource.",
    405: "This method is not allowed on this resource.",
    413: "The request body is larger than the service accepts.",
    415: "The request body must be application/json.",
    500: "The service failed to handle the request.",
}


class APIError(Exception):
    """An error the service answers on purpose, with its code, message and headers."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        *,
        headers: dict[str, str] | None = None,
        errors: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code or CODES[status]
        self.headers = headers or {}
        self.errors = errors


def error_response(
    status: int,
    code: str,
    message: str,
    headers: Any = None,
    errors: dict[str, Any] | None = None,
) -> Response:
    """The one way an Error body is built."""
    body: dict[str, Any] = {"code": code, "message": message, "status": status}
    if errors:
        body["errors"] = errors
    response = current_app.response_class(
        json.dumps(body), status=status, mimetype="application/json"
    )
    if headers:
        response.headers.extend(headers)
    return response


def handle_api_error(error: APIError) -> Response:
    return error_response(error.status, error.code, error.message, error.headers, error.errors)


def handle_http_exception(error: HTTPException) -> Response:
    status = error.code or 500
    # Keep what werkzeug put in the headers (Allow, WWW-Authenticate, Retry-After), drop its HTML.
    headers = [
        (name, value)
        for name, value in error.get_response().headers
        if name.lower() not in ("content-type", "content-length")
    ]
    message = MESSAGES.get(status) or error.description or error.name
    return error_response(status, CODES.get(status, "invalid_request"), message, headers)


def handle_database_unavailable(error: Exception) -> Response:
    # Not a bug of ours: the database is down, restarting or too slow. Say so, briefly.
    log.warning("database unavailable: %s: %s", type(error).__name__, error)
    metrics.database_unavailable(error)
    db.discard_broken_connections()
    return error_response(
        503,
        "service_unavailable",
        "The database is unavailable; retry later.",
        {"Retry-After": str(current_app.config["RETRY_AFTER"])},
    )


def handle_unexpected(error: Exception) -> Response:
    log.exception("unhandled error")
    return error_response(500, "internal_error", MESSAGES[500])


def init_app(app: Flask) -> None:
    """Register the handlers that turn every failure into the Error JSON."""
    app.register_error_handler(APIError, handle_api_error)
    app.register_error_handler(HTTPException, handle_http_exception)
    for error in DATABASE_UNAVAILABLE:
        app.register_error_handler(error, handle_database_unavailable)
    app.register_error_handler(Exception, handle_unexpected)
