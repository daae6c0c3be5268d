"""GET /metrics for Prometheus: no key, no rate limit, logged at debug level only, not under /v1."""

from __future__ import annotations

from ipaddress import ip_address

from flask import Blueprint, Response, abort, current_app, request

from petstore import metrics
from petstore.auth import public
from petstore.config import IPNetwork

bp = Blueprint("metrics", __name__)

# Where werkzeug's ProxyFix keeps the values it replaced (PETSTORE_PROXY_COUNT).
PROXY_FIX_ORIGINAL = "werkzeug.proxy_fix.orig"


@bp.get("/metrics")
@public
def scrape() -> Response:
    """Every worker's numbers in the Prometheus text format (nginx does not pass this path on).

    With PETSTORE_METRICS_ALLOW, only those networks get them; anyone else gets the 404 Error.
    """
    allowed = current_app.config["METRICS_ALLOW"]
    if allowed is not None and not scraper_allowed(allowed):
        abort(404)
    return metrics.metrics_response()


def scraper_allowed(networks: tuple[IPNetwork, ...]) -> bool:
    """Whether the peer of the connection is in one of `networks`.

    The peer, never X-Forwarded-For: Prometheus scrapes each instance directly, and behind
    PETSTORE_PROXY_COUNT whoever reaches the port could claim any address in that header.
    """
    original = request.environ.get(PROXY_FIX_ORIGINAL) or request.environ
    try:
        peer = ip_address(original.get("REMOTE_ADDR") or "")
    except ValueError:  # a Unix socket has no address
        return False
    if peer.version == 6 and peer.ipv4_mapped is not None:
        peer = peer.ipv4_mapped
    # Versions compared first: an IPv4 address is in no IPv6 network (::/0 included).
    return any(peer.version == net.version and peer in net for net in networks)
