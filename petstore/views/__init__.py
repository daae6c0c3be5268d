"""The views, one blueprint per module, and RESOURCES: the one list of the API's resources.

create_app registers the blueprints from here; the OpenAPI document describes the operations of
RESOURCES (described()), and petstore.metrics counts their requests by operationId
(operation_ids()). A new resource is a module here with its blueprint `bp` and the descriptions
of its operations, `OPERATIONS`, named in RESOURCES.
"""

from __future__ import annotations

import re
from typing import Protocol

from flask import Blueprint, Flask

from petstore.openapi import Described, Operations
from petstore.views import orders, pets, rate_limit, usage
from petstore.web import API_PREFIX


class Resource(Protocol):
    """A views module of the API: its blueprint, served under API_PREFIX, and its operations."""

    bp: Blueprint
    OPERATIONS: Operations


# The resources under /v1, in the order of the OpenAPI document's paths.
RESOURCES: tuple[Resource, ...] = (pets, rate_limit, usage, orders)

# A variable segment of a path: `<pet_id>` in a route, `{petId}` in the document.
VARIABLE = re.compile(r"<[^>]*>|\{[^}]*\}")


def described() -> list[Described]:
    """Every resource's operations as (path, method, describe), in the document's order."""
    return [entry for resource in RESOURCES for entry in resource.OPERATIONS.described]


def operation_ids(app: Flask) -> dict[str, str]:
    """Flask endpoint -> operationId of each described operation, found by its route's path and
    method (the app's blueprints registered)."""
    by_route = {
        (method.upper(), VARIABLE.sub("{}", API_PREFIX + path)): describe
        for path, method, describe in described()
    }
    ids = {}
    for rule in app.url_map.iter_rules():
        for method in sorted(rule.methods or ()):
            describe = by_route.get((method, VARIABLE.sub("{}", rule.rule)))
            if describe is not None:
                ids[rule.endpoint] = describe(app.config)["operationId"]
    return ids
