"""Store orders: referenced by the spec, never described, so not invented here."""

from __future__ import annotations

from flask import Blueprint, Response

from petstore.errors import APIError

bp = Blueprint("orders", __name__)


@bp.get("/store/orders")
def list_orders() -> Response:
    """The spec names this operation but shows no parameters or payloads: 501."""
    raise APIError(
        501,
        "Store orders are not specified by the Animal Store specification and are not implemented.",
    )
