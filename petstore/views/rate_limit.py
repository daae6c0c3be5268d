"""GET /v1/rate_limit: the caller's own standing, spending no budget (like GitHub's /rate_limit)."""

from __future__ import annotations

from flask import Blueprint, Response, current_app, g

from petstore import budgets, schemas
from petstore.auth import uncounted

bp = Blueprint("rate_limit", __name__)


@bp.get("/rate_limit")
@uncounted
def get_rate_limit() -> Response:
    """getRateLimit: plan, limits, ban and strikes of the key; 200 also while throttled or banned."""
    body = schemas.rate_limit.dumps(budgets.standing_of(g.caller))
    return current_app.response_class(body, mimetype="application/json")
