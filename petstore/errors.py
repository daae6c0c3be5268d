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

# Every Error code the service answers with, wherever the refusal is made (the app,
# petstore.gunicorn_glue.REFUSALS, nginx's error pages): code -> (status, the message when nothing
# more specific is said). The OpenAPI document lists each status's codes from here, in order;
# tests/app/test_deploy_files.py checks gunicorn's and nginx's codes against it.
ERRORS: dict[str, tuple[int, str | None]] = {
    "invalid_request": (400, None),
    "unauthorized": (401, None),
    "insufficient_scope": (403, None),
    "forbidden": (403, None),
    "not_found": (404, "No such resource."),
    "method_not_allowed": (405, "This method is not allowed on this resource."),
    "idempotency_key_reused": (409, None),
    "gone": (410, None),
    "payload_too_large": (413, "The request body is larger than the service accepts."),
    "uri_too_long": (414, None),
    "unsupported_media_type": (415, "The request body must be application/json."),
    "expectation_failed": (417, None),
    "rate_limited": (429, None),
    "api_key_banned": (429, None),
    "headers_too_large": (431, None),
    "internal_error": (500, "The service failed to handle the request."),
    "not_implemented": (501, None),
    "service_unavailable": (503, None),
}

# The code of an error werkzeug raises itself, by its status (any other status: invalid_request).
CODES = {
    ERRORS[code][0]: code
    for code in (
        "invalid_request",
        "unauthorized",
        "not_found",
        "method_not_allowed",
        "gone",
        "payload_too_large",
        "unsupported_media_type",
        "rate_limited",
        "internal_error",
        "not_implemented",
        "service_unavailable",
    )
}

# The message of an error werkzeug raises itself, where ours says more than its description.
MESSAGES = {ERRORS[code][0]: message for code in CODES.values() if (message := ERRORS[code][1])}


def codes_of(status: int) -> tuple[str, ...]:
    """The Error codes answered with this status, in the table's order."""
    return tuple(code for code, (code_status, _message) in ERRORS.items() if code_status == status)


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
    status: int, code: str, message: str, headers: Any = None, errors: dict[str, Any] | None = None
) -> Response:
    """The one way an Error body is built."""
    body: dict[str, Any] = {"code": code, "message": message, "status": status}
    if errors:
        body["errors"] = errors
    # Ended by a newline, as every JSON body (web.json_response, nginx's and gunicorn's pages).
    response = current_app.response_class(
        json.dumps(body) + "\n", status=status, mimetype="application/json"
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


def handle_read_only(error: psycopg.errors.ReadOnlySqlTransaction) -> Response:
    # A write on a server that is no longer the primary (after a failover): no primary for us yet.
    db.discard_read_only_connections()
    return handle_database_unavailable(error)


def handle_internal_error(error: psycopg.InternalError) -> Response:
    # psycopg's own InternalError (no SQLSTATE), as when the server dies during a COMMIT behind
    # PgBouncer ("received 2 results from command 'COMMIT'"): whether the commit happened is
    # unknown, which a retry with the Idempotency-Key settles. 503, and the connection is never
    # used again. The server's own (a SQLSTATE) stay bugs: 500.
    if error.sqlstate is not None:
        return handle_unexpected(error)
    db.close_request_connection()
    return handle_database_unavailable(error)


def handle_unexpected(error: Exception) -> Response:
    log.exception("unhandled error")
    return error_response(500, "internal_error", MESSAGES[500])


def init_app(app: Flask) -> None:
    """Register the handlers that turn every failure into the Error JSON."""
    app.register_error_handler(APIError, handle_api_error)
    app.register_error_handler(HTTPException, handle_http_exception)
    for error in DATABASE_UNAVAILABLE:
        app.register_error_handler(error, handle_database_unavailable)
    app.register_error_handler(psycopg.errors.ReadOnlySqlTransaction, handle_read_only)
    app.register_error_handler(psycopg.InternalError, handle_internal_error)
    app.register_error_handler(Exception, handle_unexpected)
