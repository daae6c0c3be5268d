"""marshmallow schemas: what a request may contain and what a response shows."""

from __future__ import annotations

import re
from typing import Any

from marshmallow import RAISE, Schema, ValidationError, fields, validate

from petstore.plans import PLANS

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
PET_STATUSES = ("available", "pending", "sold")
DIGITS = re.compile(r"[0-9]{1,19}")
# A JSON Schema (ECMA-262) pattern for text PostgreSQL can store: no NUL character.
NO_NUL_PATTERN = "^[^\\u0000]*$"
STATUS_DESCRIPTION = "Availability: one of `available`, `pending`, `sold`."
CATEGORY_ID = {
    "format": "int64",
    "description": "Identifier of the category the animal belongs to.",
    "example": 1,
}


class QueryInteger(fields.Integer):
    """An integer in a query string: ASCII digits only (no sign, space, '1.5' or '٣')."""

    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> int:
        if not isinstance(value, str) or not DIGITS.fullmatch(value):
            raise self.make_error("invalid")
        return super()._deserialize(value, attr, data, **kwargs)


class StorableText(fields.String):
    """A string PostgreSQL text can hold: no NUL character, and no lone surrogate ("\\ud800" is
    valid JSON, not UTF-8). Checked in the field itself: a @validates hook costs as much again
    as the rest of the load."""

    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> str:
        text: str = super()._deserialize(value, attr, data, **kwargs)
        if "\x00" in text:
            raise ValidationError("Must not contain the NUL character.")
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise ValidationError("Must be valid Unicode: no unpaired surrogate.") from None
        return text


class NewPetSchema(Schema):
    """The body of POST /pets; `id` and any other unknown field are refused."""

    class Meta:
        unknown = RAISE

    name = StorableText(
        required=True,
        validate=validate.Length(min=1),
        metadata={
            "description": "The animal's name: not empty, no NUL character.",
            # What StorableText checks, for the API description (JSON Schema has no NUL check).
            "pattern": NO_NUL_PATTERN,
            "example": "Rex",
        },
    )
    category_id = fields.Integer(
        data_key="categoryId",
        required=True,
        strict=True,
        validate=validate.Range(min=INT64_MIN, max=INT64_MAX),
        metadata=CATEGORY_ID,
    )
    status = fields.String(
        validate=validate.OneOf(PET_STATUSES),
        metadata={"description": STATUS_DESCRIPTION, "example": "available"},
    )


NEW_PET_KEYS = frozenset(("name", "categoryId", "status"))


def plain_new_pet(data: Any) -> dict[str, Any] | None:
    """A NewPet body of the common shape loaded without marshmallow, else None (load it then).

    What NewPetSchema.load gives for the bodies clients send (an ASCII name, an int
    categoryId, a known status or none), at a tenth of its cost, which was a create's largest
    own cost; anything else (an error, a non-ASCII name) goes through the schema, which stays
    the one definition of a valid NewPet (tests/app/test_schemas.py compares both).
    """
    if type(data) is not dict or not data.keys() <= NEW_PET_KEYS:
        return None
    name = data.get("name")
    category_id = data.get("categoryId")
    if (
        type(name) is not str
        or not name
        or not name.isascii()
        or "\x00" in name
        or type(category_id) is not int
        or not INT64_MIN <= category_id <= INT64_MAX
    ):
        return None
    if "status" not in data:
        return {"name": name, "category_id": category_id}
    status = data["status"]
    if type(status) is not str or status not in PET_STATUSES:
        return None
    return {"name": name, "category_id": category_id, "status": status}


class PetSchema(Schema):
    """A Pet as the service returns it; a status that was never stated is left out.

    PostgreSQL writes the bytes (the SQL function pet_json); this schema describes them in the
    API document, and the schemathesis tests check that the two agree.
    """

    id = fields.Integer(
        required=True,
        metadata={
            "format": "int64",
            "description": "Unique identifier, assigned by the service on creation.",
            "example": 1,
        },
    )
    name = fields.String(
        required=True, metadata={"description": "The animal's name.", "example": "Rex"}
    )
    category_id = fields.Integer(data_key="categoryId", required=True, metadata=CATEGORY_ID)
    # Only what NewPetSchema let in is ever stored (and the database checks it again).
    status = fields.String(
        metadata={
            "enum": list(PET_STATUSES),
            "description": STATUS_DESCRIPTION + " Left out when it was never stated.",
            "example": "available",
        }
    )


class ListPetsQuery(Schema):
    """The query string of GET /pets."""

    class Meta:
        unknown = RAISE

    limit = QueryInteger(
        load_default=20,
        validate=validate.Range(min=1, max=100),
        metadata={"description": "Largest number of pets on the page."},
    )
    status = fields.String(
        validate=validate.OneOf(PET_STATUSES),
        metadata={"description": "Only pets with this status."},
    )
    after = QueryInteger(
        load_default=0,
        validate=validate.Range(min=0, max=INT64_MAX),
        metadata={
            "format": "int64",
            "description": (
                "Cursor: the id of the last pet of the previous page (pets with a greater id "
                'follow). The `Link: rel="next"` header of a full page carries it.'
            ),
        },
    )


class ErrorSchema(Schema):
    """The body of every error response."""

    code = fields.String(
        required=True,
        metadata={"description": "Machine-readable error code.", "example": "invalid_request"},
    )
    message = fields.String(
        required=True,
        metadata={
            "description": "Human-readable description.",
            "example": "Invalid value for: name.",
        },
    )
    status = fields.Integer(
        required=True, metadata={"description": "The HTTP status code.", "example": 400}
    )
    errors = fields.Dict(
        keys=fields.String(),
        values=fields.List(fields.String()),
        metadata={
            "description": "Only on a 400 for invalid fields: each bad field with its complaints.",
            "example": {"name": ["Shorter than minimum length 1."]},
        },
    )


class WindowSchema(Schema):
    """One limit of the caller, in its current window."""

    limit = fields.Integer(
        required=True, metadata={"description": "Requests allowed per window.", "example": 60}
    )
    remaining = fields.Integer(
        required=True, metadata={"description": "Requests left in this window.", "example": 42}
    )
    used = fields.Integer(
        required=True,
        metadata={
            "description": "Requests counted in this window (`limit - remaining`).",
            "example": 18,
        },
    )
    reset = fields.Integer(
        required=True,
        metadata={
            "description": "When this window ends: unix time, in seconds.",
            "example": 1795662559,
        },
    )


class BanSchema(Schema):
    """An active ban of the key."""

    until = fields.Integer(
        required=True,
        metadata={
            "description": "When the ban ends: unix time, in seconds.",
            "example": 1795662559,
        },
    )


class StrikesSchema(Schema):
    """429s counted against the key in the current strike window."""

    count = fields.Integer(
        required=True, metadata={"description": "Strikes so far in this window.", "example": 0}
    )
    threshold = fields.Integer(
        required=True,
        metadata={"description": "Strikes in one window that ban the key.", "example": 10},
    )


class RateLimitSchema(Schema):
    """The caller's own standing: GET /rate_limit."""

    plan = fields.String(
        required=True,
        metadata={"enum": list(PLANS), "description": "The key's plan.", "example": "free"},
    )
    limits = fields.Dict(
        keys=fields.String(),
        values=fields.Nested(WindowSchema),
        required=True,
        metadata={
            "description": "Each limit by its window (`minute`, `day`), with the key's own "
            "numbers (enterprise and per-key overrides included)."
        },
    )
    ban = fields.Nested(
        BanSchema,
        required=True,
        allow_none=True,
        metadata={"description": "The active ban, or null."},
    )
    strikes = fields.Nested(StrikesSchema, required=True)


GRANULARITIES = ("day", "hour")


class UsageQuery(Schema):
    """The query string of GET /usage."""

    class Meta:
        unknown = RAISE

    since = fields.Date(
        data_key="from",
        metadata={
            "description": "The first UTC day, included (default: today).",
            "example": "2026-11-01",
        },
    )
    until = fields.Date(
        data_key="to",
        metadata={
            "description": "The last UTC day, included (default: today).",
            "example": "2026-11-26",
        },
    )
    granularity = fields.String(
        load_default="day",
        validate=validate.OneOf(GRANULARITIES),
        metadata={"description": "One bucket per UTC day or per UTC hour."},
    )


class OutcomesSchema(Schema):
    """A bucket's requests by outcome."""

    ok = fields.Integer(
        required=True,
        data_key="2xx",
        metadata={"description": "Answered with a status below 400.", "example": 120},
    )
    client_error = fields.Integer(
        required=True,
        data_key="4xx",
        metadata={"description": "Refused with a 4xx other than 429.", "example": 2},
    )
    too_many = fields.Integer(
        required=True,
        data_key="429",
        metadata={"description": "Refused with 429 (rate limited or banned).", "example": 8},
    )
    server_error = fields.Integer(
        required=True, data_key="5xx", metadata={"description": "Failed with a 5xx.", "example": 0}
    )


class UsageBucketSchema(Schema):
    """One period with requests."""

    start = fields.String(
        required=True,
        metadata={
            "format": "date-time",
            "description": "When the period starts (UTC).",
            "example": "2026-11-26T00:00:00Z",
        },
    )
    requests = fields.Integer(
        required=True,
        metadata={
            "description": "Every request of the period: the sum of `outcomes`.",
            "example": 130,
        },
    )
    outcomes = fields.Nested(OutcomesSchema, required=True)


class UsageSchema(Schema):
    """The calling key's own requests: GET /usage."""

    key_id = fields.Integer(
        required=True,
        metadata={"format": "int64", "description": "The calling key's id.", "example": 7},
    )
    granularity = fields.String(
        required=True, metadata={"enum": list(GRANULARITIES), "example": "day"}
    )
    since = fields.String(
        required=True, data_key="from", metadata={"format": "date", "example": "2026-11-01"}
    )
    until = fields.String(
        required=True, data_key="to", metadata={"format": "date", "example": "2026-11-26"}
    )
    usage = fields.List(
        fields.Nested(UsageBucketSchema),
        required=True,
        metadata={"description": "One bucket per period that has requests, oldest first."},
    )


new_pet = NewPetSchema()
list_pets_query = ListPetsQuery()
rate_limit = RateLimitSchema()
usage_query = UsageQuery()
usage = UsageSchema()
