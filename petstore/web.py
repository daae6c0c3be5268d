"""Request and response plumbing shared by every view: the API's path scope, bodies, validation, JSON."""

from __future__ import annotations

import json
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from flask import Response, current_app, g, request
from gunicorn.http.errors import ParseException
from marshmallow import Schema, ValidationError
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge, UnsupportedMediaType

from petstore.errors import APIError

API_PREFIX = "/v1"
QUERY_CACHE_SIZE = 1024
QUERY_CACHE: dict[tuple[int, bytes], Mapping[str, Any]] = {}


def in_api() -> bool:
    """Whether the request's path is under the API, unknown paths included."""
    path = request.path
    return path == API_PREFIX or path.startswith(API_PREFIX + "/")


def json_response(body: str, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A response of JSON text (written by PostgreSQL or a schema), ended by a newline."""
    # As Flask's jsonify ends its bodies: curl's output then ends its line before the prompt.
    return current_app.response_class(
        body + "\n", status=status, headers=headers, mimetype="application/json"
    )


def read_body_or_error() -> bytes | APIError | HTTPException:
    """Read the body now (read_capped_body) and return it, or the error reading raised, for the
    pipeline to store in g.body; stored_body answers with it later."""
    try:
        return read_capped_body()
    except (APIError, HTTPException) as exc:
        return exc


def stored_body() -> bytes:
    """The request body the pipeline stored (else read now): see read_capped_body."""
    body = g.get("body")
    if body is None:
        return read_capped_body()
    if isinstance(body, Exception):
        raise body
    data: bytes = body
    return data


def read_capped_body() -> bytes:
    """Read the body from the client: 413 when it is longer than MAX_CONTENT_LENGTH, 400 when
    its framing is broken."""
    # gunicorn takes "gzip, chunked" for chunked and hands on the bytes undecoded; nginx refuses
    # any coding but chunked. Refuse it here too, so that both layers agree.
    req = request._get_current_object()  # type: ignore[attr-defined]
    coding = req.environ.get("HTTP_TRANSFER_ENCODING")
    if coding is not None and coding.strip().lower() != "chunked":
        raise APIError(400, "The Transfer-Encoding of the request is not supported.")
    try:
        data: bytes = req.get_data(cache=False)
        # Without a Content-Length (chunked), werkzeug stops reading at the cap without
        # complaint: a byte left unread means the body was longer.
        if req.content_length is None:
            cap = req.max_content_length
            if cap is not None and len(data) >= cap and req.input_stream.read(1):
                raise RequestEntityTooLarge()
    except ParseException:
        # A body the client framed wrongly (a chunk size of "zz", no CRLF after a chunk's data):
        # gunicorn raises it through werkzeug's stream, and closes the connection after the answer.
        raise APIError(
            400, "The request body is malformed: its chunked encoding is broken."
        ) from None
    return data


def body_as_json() -> Any:
    """The stored request body parsed as JSON; 415 unless it is application/json, 400 unless it
    parses."""
    if request.mimetype != "application/json":
        raise UnsupportedMediaType()
    data = stored_body()
    try:
        # The standard library's, as Flask's default JSON provider calls it, without the
        # provider lookup on the application context.
        return json.loads(data)
    except ValueError:
        raise APIError(400, "The request body is not valid JSON.") from None
    except RecursionError:
        # The C decoder recurses once per nesting level; no valid NewPet nests deeper than one.
        raise APIError(400, "The request body is nested too deeply.") from None


def validate_query(schema: Schema) -> Mapping[str, Any]:
    """The query string loaded with `schema`, remembered by the raw query string.

    Same input, same answer: clients repeat the same few query strings, and loading one costs
    more than the rest of our request path. Only valid ones are remembered, at most
    QUERY_CACHE_SIZE of them; the answer is read-only, since threads share it.
    """
    cache_key = (id(schema), request.query_string)
    loaded = QUERY_CACHE.get(cache_key)
    if loaded is None:
        loaded = MappingProxyType(validate(schema, request.args.to_dict()))
        if len(QUERY_CACHE) >= QUERY_CACHE_SIZE:
            QUERY_CACHE.clear()
        QUERY_CACHE[cache_key] = loaded
    return loaded


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
