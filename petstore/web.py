"""Request and response plumbing shared by every view: the API's path scope, bodies, validation, JSON."""

from __future__ import annotations

from typing import Any

from flask import Response, current_app, json, request
from gunicorn.http.errors import ParseException
from marshmallow import Schema, ValidationError
from werkzeug.exceptions import RequestEntityTooLarge, UnsupportedMediaType

from petstore.errors import APIError

API_PREFIX = "/v1"


def in_api() -> bool:
    """Whether the request's path is under the API, unknown paths included."""
    path = request.path
    return path == API_PREFIX or path.startswith(API_PREFIX + "/")


def json_response(body: str, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A response of JSON text written by PostgreSQL."""
    return current_app.response_class(
        body, status=status, headers=headers, mimetype="application/json"
    )


# What reading a body the client framed wrongly raises through werkzeug's stream: gunicorn's
# parse errors (a chunk size of "zz" or "-1", a size line too long, no CRLF after a chunk's data).
# An OSError (a body that ended early) werkzeug turns into its own 400. gunicorn closes the
# connection after the answer: where the next request would start is unknown.
MALFORMED_BODY = ParseException


def request_body() -> bytes:
    """The request body; 413 when it is longer than MAX_CONTENT_LENGTH, chunked bodies included.

    400 when its framing is broken, before anything is stored.
    """
    # gunicorn takes "gzip, chunked" for chunked and hands on the bytes undecoded; nginx refuses
    # any coding but chunked. Refuse it here too, so that both layers agree.
    coding = request.headers.get("Transfer-Encoding")
    if coding is not None and coding.strip().lower() != "chunked":
        raise APIError(400, "The Transfer-Encoding of the request is not supported.")
    try:
        data = request.get_data(cache=False)
        cap = request.max_content_length
        # Without a Content-Length (chunked), werkzeug stops reading at the cap without
        # complaint: a byte left unread means the body was longer.
        if request.content_length is None and cap is not None and len(data) >= cap:
            if request.input_stream.read(1):
                raise RequestEntityTooLarge()
    except MALFORMED_BODY:
        raise APIError(
            400, "The request body is malformed: its chunked encoding is broken."
        ) from None
    return data


def json_body() -> Any:
    """The request body as JSON; 415 unless it is application/json, 400 unless it parses."""
    if request.mimetype != "application/json":
        raise UnsupportedMediaType()
    data = request_body()
    try:
        return json.loads(data)
    except ValueError:
        raise APIError(400, "The request body is not valid JSON.") from None
    except RecursionError:
        # The C decoder recurses once per nesting level; no valid NewPet nests deeper than one.
        raise APIError(400, "The request body is nested too deeply.") from None


def validate(schema: Schema, data: Any) -> dict[str, Any]:
    """Load `data` with `schema`, turning its complaints into a 400 naming each field."""
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.")
    try:
        loaded: dict[str, Any] = schema.load(data)
    except ValidationError as exc:
        assert isinstance(exc.messages, dict)
        names = ", ".join(sorted(exc.messages))
        raise APIError(400, f"Invalid value for: {names}.", errors=exc.messages) from None
    return loaded
