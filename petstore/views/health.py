"""Liveness: no key, no database."""

from __future__ import annotations

from flask import Blueprint, Response, current_app

from petstore.auth import public

bp = Blueprint("health", __name__)


@bp.get("/healthz")
@public
def healthz() -> Response:
    """The process is alive and answering."""
    return current_app.response_class('{"status":"ok"}', mimetype="application/json")
