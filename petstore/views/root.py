"""GET /: nothing lives there; a 404 in the Error shape that says where the API and its docs are."""

from __future__ import annotations

from flask import Blueprint, Response

from petstore.auth import public
from petstore.errors import error_response
from petstore.web import API_PREFIX

bp = Blueprint("root", __name__)

MESSAGE = (
    f"Nothing is served at /. The API lives under {API_PREFIX}: its documentation is at "
    f"{API_PREFIX}/docs, its OpenAPI document at {API_PREFIX}/openapi.json."
)
# RFC 8631 link relations, for clients that follow links rather than read messages.
LINKS = f'<{API_PREFIX}/docs>; rel="service-doc", <{API_PREFIX}/openapi.json>; rel="service-desc"'


@bp.get("/")
@public
def root() -> Response:
    """A 404 pointing to /v1/docs and /v1/openapi.json."""
    return error_response(404, "not_found", MESSAGE, {"Link": LINKS})
