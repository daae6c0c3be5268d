"""The blueprints. Every API route lives under API_PREFIX; health probes live outside it."""

from __future__ import annotations

from flask import request

API_PREFIX = "/v1"


def in_api() -> bool:
    """Whether the request's path is under the API, unknown paths included."""
    path = request.path
    return path == API_PREFIX or path.startswith(API_PREFIX + "/")
