"""schemas.plain_new_pet, the common NewPet bodies loaded without marshmallow: it gives what
NewPetSchema.load gives, and leaves every other body to the schema."""

from __future__ import annotations

from typing import Any

import pytest
from marshmallow import ValidationError

from petstore import schemas

COMMON = [
    {"name": "Rex", "categoryId": 1},
    {"name": "Rex", "categoryId": 1, "status": "available"},
    {"status": "sold", "categoryId": -(2**63), "name": "x"},
    {"name": " spaced ", "categoryId": 2**63 - 1, "status": "pending"},
    {"name": "a\ttab", "categoryId": 0},
]
# Each of these is the schema's: an error, or a body the fast path does not claim.
OTHERS: list[Any] = [
    [],
    "Rex",
    None,
    {},
    {"name": "Rex"},
    {"categoryId": 1},
    {"name": "", "categoryId": 1},
    {"name": "R\x00x", "categoryId": 1},
    {"name": "Rëx", "categoryId": 1},
    {"name": "\ud800", "categoryId": 1},
    {"name": 7, "categoryId": 1},
    {"name": None, "categoryId": 1},
    {"name": "Rex", "categoryId": True},
    {"name": "Rex", "categoryId": 1.0},
    {"name": "Rex", "categoryId": "1"},
    {"name": "Rex", "categoryId": 2**63},
    {"name": "Rex", "categoryId": -(2**63) - 1},
    {"name": "Rex", "categoryId": None},
    {"name": "Rex", "categoryId": 1, "status": None},
    {"name": "Rex", "categoryId": 1, "status": "lost"},
    {"name": "Rex", "categoryId": 1, "status": 1},
    {"name": "Rex", "categoryId": 1, "id": 5},
    {"name": "Rex", "categoryId": 1, "category_id": 1},
]


@pytest.mark.parametrize("body", COMMON)
def test_a_common_body_loads_as_the_schema_loads_it(body: dict[str, Any]) -> None:
    loaded = schemas.plain_new_pet(body)

    assert loaded == schemas.new_pet.load(body)
    assert loaded is not None and list(loaded) == list(schemas.new_pet.load(body))


@pytest.mark.parametrize("body", OTHERS)
def test_any_other_body_is_left_to_the_schema(body: Any) -> None:
    assert schemas.plain_new_pet(body) is None
    if isinstance(body, dict) and body.get("name") == "Rëx":
        assert schemas.new_pet.load(body) == {"name": "Rëx", "category_id": 1}
    elif isinstance(body, dict):
        with pytest.raises(ValidationError):
            schemas.new_pet.load(body)
