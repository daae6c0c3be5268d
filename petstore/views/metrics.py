"""GET /metrics for Prometheus: no key, no rate limit, logged at debug level only, not under /v1."""

from __future__ import annotations

from flask import Blueprint, Response

from petstore import metrics
from petstore.auth import public

bp = Blueprint("metrics", __name__)


@bp.get("/metrics")
@public
def scrape() -> Response:
    """Every worker's numbers in the Prometheus text format (nginx does not pass this path on)."""
    return metrics.metrics_response()
