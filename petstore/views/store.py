"""The store: orders are referenced by the spec, never described, so not invented here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flask import Response

from petstore.errors import APIError
from petstore.openapi import Resource, errors, operation_object

bp = Resource(
    "store",
    __name__,
    tag="store",
    tag_description="Store orders (named by the specification only).",
)


def list_orders_operation(config: Mapping[str, Any]) -> dict[str, Any]:
    """listOrders' Operation Object: why it answers 501."""
    return operation_object(
        "List store orders (not implemented)",
        "The specification names this operation but shows none of its parameters or "
        "payloads, nor the fields of an order. Rather than invent them, the service answers "
        "501 to every authorized call.",
        errors((501, "Store orders are not specified, so they are not implemented.")),
    )


@bp.operation("/store/orders", "get", "listOrders", list_orders_operation)
def list_orders() -> Response:
    """The spec names this operation but shows no parameters or payloads: 501."""
    raise APIError(
        501,
        "Store orders are not specified by the Animal Store specification and are not implemented.",
    )
