"""The views, one blueprint per module, and RESOURCES: the one list of the API's resources.

A resource is a views module whose `bp` is a petstore.openapi.Resource. create_app registers
RESOURCES under /v1, the OpenAPI document describes them, and petstore.metrics counts their
requests by operationId. A new operation of a resource touches its module only.
"""

from __future__ import annotations

from flask import Flask

from petstore import openapi
from petstore.openapi import Operation, Resource
from petstore.views import pets, rate_limit, store, usage

# The resources under /v1, in the order of the OpenAPI document's tags and paths.
RESOURCES: tuple[Resource, ...] = (pets.bp, store.bp, rate_limit.bp, usage.bp)


def operations() -> list[Operation]:
    """Every resource's operations, in the document's order."""
    return [operation for resource in RESOURCES for operation in resource.operations]


def operation_ids(app: Flask) -> dict[str, str]:
    """Flask endpoint -> operationId of each operation of the RESOURCES the app registered."""
    return openapi.operation_ids(
        resource for resource in RESOURCES if resource.name in app.blueprints
    )
