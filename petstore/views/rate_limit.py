"""GET /v1/rate_limit: the caller's own standing, spending no budget (like GitHub's /rate_limit)."""

from __future__ import annotations

from flask import Response

from petstore import openapi, schemas
from petstore.auth import current_caller, uncounted
from petstore.ratelimit import budgets
from petstore.web import json_response

bp = openapi.Resource(
    "rate_limit",
    __name__,
    tag="rate limits",
    tag_description="The caller's own budget and standing.",
    schemas={"RateLimit": schemas.RateLimitSchema},
)


def get_rate_limit_operation(config: openapi.Settings) -> openapi.Object:
    """getRateLimit's Operation Object."""
    return openapi.operation_object(
        "The caller's own rate limits, ban and strikes",
        "Spends no budget and counts no strike, and answers 200 also while the key is "
        "throttled or banned, so a client can learn when to come back. Without a valid key it "
        "is a 401 like any other operation, counted against the client's address.",
        openapi.ok(
            200,
            "RateLimit",
            "The key's standing; X-RateLimit-* show the limit nearest to running out.",
        ),
        openapi.errors(),
    )


@bp.operation("/rate_limit", "get", "getRateLimit", get_rate_limit_operation)
@uncounted
def get_rate_limit() -> Response:
    """getRateLimit: plan, limits, ban and strikes of the key; 200 also while throttled or banned."""
    standing, shown = budgets.rate_limit_standing(current_caller())
    response = json_response(schemas.rate_limit.dumps(standing))
    # The pipeline counted nothing for this view, so these are the only X-RateLimit-* it gets.
    budgets.set_headers(response, shown)
    return response
