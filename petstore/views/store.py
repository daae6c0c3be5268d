"""The store: orders are referenced by the spec, never described, so not invented here."""

from __future__ import annotations

from flask import Response

from petstore import openapi
from petstore.errors import APIError

bp = openapi.Resource(
    "store",
    __name__,
    tag="store",
    tag_description="Store orders (named by the specification only).",
)


def list_orders_operation(config: openapi.Settings) -> openapi.Object:
    """listOrders' Operation Object: why it answers 501."""
    return openapi.operation_object(
        "List store orders (not implemented)",
        "The specification names this operation but shows none of its parameters or "
        "payloads, nor the fields of an order. Rather than invent them, the service answers "
        "501 to every authorized call.",
        openapi.errors((501, "Store orders are not specified, so they are not implemented.")),
    )


@bp.operation("/store/orders", "get", "listOrders", list_orders_operation)
def list_orders() -> Response:
    """The spec names this operation but shows no parameters or payloads: 501."""
    raise APIError(
        501,
        "Store orders are not specified by the Animal Store specification and are not implemented.",
    )
