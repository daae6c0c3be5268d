"""marshmallow schemas: what a request may contain and what a response shows."""

from __future__ import annotations

import re
from typing import Any

from marshmallow import RAISE, Schema, ValidationError, fields, post_dump, validate, validates

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
PET_STATUSES = ("available", "pending", "sold")
DIGITS = re.compile(r"[0-9]{1,19}")


class QueryInteger(fields.Integer):
    """An integer in a query string: ASCII digits only (no sign, space, '1.5' or '٣')."""

    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> int:
        if not isinstance(value, str) or not DIGITS.fullmatch(value):
            raise self.make_error("invalid")
        return super()._deserialize(value, attr, data, **kwargs)


class NewPetSchema(Schema):
    """The body of POST /pets; `id` and any other unknown field are refused."""

    class Meta:
        unknown = RAISE

    name = fields.String(required=True, validate=validate.Length(min=1))
    category_id = fields.Integer(
        data_key="categoryId",
        required=True,
        strict=True,
        validate=validate.Range(min=INT64_MIN, max=INT64_MAX),
    )
    status = fields.String(validate=validate.OneOf(PET_STATUSES))

    @validates("name")
    def storable_text(self, value: str, **kwargs: Any) -> None:
        # PostgreSQL text cannot hold NUL, nor UTF-8 a lone surrogate ("\ud800" is valid JSON):
        # say so instead of failing in the database.
        if "\x00" in value:
            raise ValidationError("Must not contain the NUL character.")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValidationError("Must be valid Unicode: no unpaired surrogate.") from None


class PetSchema(Schema):
    """A Pet as the service returns it; a status that was never stated is left out."""

    id = fields.Integer(required=True)
    name = fields.String(required=True)
    category_id = fields.Integer(data_key="categoryId", required=True)
    status = fields.String()

    @post_dump
    def leave_out_unstated_status(self, data: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        if data.get("status") is None:
            data.pop("status", None)
        return data


class ListPetsQuery(Schema):
    """The query string of GET /pets."""

    class Meta:
        unknown = RAISE

    limit = QueryInteger(load_default=20, validate=validate.Range(min=1, max=100))
    status = fields.String(validate=validate.OneOf(PET_STATUSES))
    after = QueryInteger(
        load_default=0,
        validate=validate.Range(min=0, max=INT64_MAX),
        metadata={"description": "Cursor: the id of the last pet of the previous page."},
    )


class ErrorSchema(Schema):
    """The body of every error response."""

    code = fields.String(required=True)
    message = fields.String(required=True)
    status = fields.Integer(required=True)


new_pet = NewPetSchema()
pet = PetSchema()
list_pets_query = ListPetsQuery()
