"""The pets resource: list, create, and the deprecated get-one; each view routed with its Operation Object."""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from typing import Any

from flask import Response, current_app
from werkzeug.http import http_date

from petstore import idempotency, schemas
from petstore.auth import current_caller, needs_scope
from petstore.db import Connection, get_conn
from petstore.durable import durable_write
from petstore.errors import APIError
from petstore.openapi import (
    Resource,
    errors,
    header,
    idempotency_key,
    json_body,
    lacks_scope,
    ok,
    operation_object,
)
from petstore.queries import pets as pet_sql
from petstore.standbys import read_on_standby_if_any
from petstore.web import API_PREFIX, body_as_json, json_response, validate, validate_query


def header_components(config: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The headers of the pets' responses, by component id: Location, the replay flag, the next
    page, and getPet's deprecation."""
    text = {"type": "string"}
    return {
        "Location": header("The path of the new pet.", {**text, "example": "/v1/pets/1"}),
        "Idempotent-Replayed": header(
            "`true` when this is the stored first response to an earlier request "
            "with the same `Idempotency-Key`, replayed.",
            {**text, "enum": ["true"]},
            required=False,
        ),
        "NextPage": header(
            'The next page, on full pages only: `<url>; rel="next"` (RFC 8288); its '
            "`after` parameter is the id of the last pet of this page.",
            {**text, "example": '</v1/pets?limit=20&after=20>; rel="next"'},
            required=False,
        ),
        "Deprecation": header(
            "When this operation became deprecated (RFC 9745): `@` and unix seconds.",
            {**text, "pattern": "^@-?[0-9]+$", "example": f"@{config['DEPRECATED_AT']}"},
        ),
        "Sunset": header(
            "When this operation goes away (RFC 8594), as an HTTP date.",
            {**text, "example": http_date(config["SUNSET"])},
        ),
        "SuccessorLink": header(
            "The replacement: `GET /v1/pets` (with the `status` filter).",
            {**text, "example": '</v1/pets>; rel="successor-version"'},
        ),
    }


bp = Resource(
    "pets",
    __name__,
    tag="pets",
    tag_description="The animals of the catalogue.",
    schemas={"NewPet": schemas.NewPetSchema, "Pet": schemas.PetSchema},
    headers=header_components,
)

PET_ID = schemas.DIGITS
# getPet's Deprecation, Sunset and successor Link headers: the header name -> component id.
DEPRECATION = {"Deprecation": "Deprecation", "Sunset": "Sunset", "Link": "SuccessorLink"}


def list_pets_operation(config: Mapping[str, Any]) -> dict[str, Any]:
    """listPets' Operation Object."""
    return operation_object(
        "List pets",
        "Pets by id ascending, at most `limit` of them, optionally only those of one `status`. "
        'A full page carries `Link: <...>; rel="next"` to the next one (a keyset cursor, '
        "`after`). Unknown query parameters are refused (400).",
        ok(200, "Pet", "A page of pets.", many=True, headers={"Link": "NextPage"}),
        errors(400),
        parameters=[{"in": "query", "schema": schemas.ListPetsQuery}],
    )


@bp.operation("/pets", "get", "listPets", list_pets_operation)
def list_pets() -> Response:
    """listPets: one page by id ascending; a Link rel=next when the page is full."""
    query = validate_query(schemas.list_pets_query)
    status = query.get("status")
    if status is None:
        page = read_on_standby_if_any(pet_sql.list_pets, after=query["after"], limit=query["limit"])
    else:
        page = read_on_standby_if_any(
            pet_sql.list_pets_by_status, status=status, after=query["after"], limit=query["limit"]
        )
    headers = {}
    if page["count"] == query["limit"]:
        # Digits, and a status from PET_STATUSES: nothing to percent-encode.
        following = f"limit={query['limit']}&after={page['last_id']}"
        if status is not None:
            following += f"&status={status}"
        headers["Link"] = f'<{API_PREFIX}/pets?{following}>; rel="next"'
    return json_response(page["pets"], headers=headers)


def create_pet_operation(config: Mapping[str, Any]) -> dict[str, Any]:
    """createPet's Operation Object."""
    new_pet = {"operationId": "getPet", "parameters": {"petId": "$response.body#/id"}}
    return operation_object(
        "Add a pet",
        "Stores a NewPet and answers the Pet with its new `id`. A `status` left out stays "
        "unstated (it is not defaulted).",
        ok(
            201,
            "Pet",
            "Created; `Location` is the new pet's path. A repeat with the same "
            "`Idempotency-Key` replays this first response.",
            headers=("Location", "Idempotent-Replayed"),
            links={"GetPetById": {**new_pet, "description": "The new pet, by its `id`."}},
        ),
        errors(
            400,
            lacks_scope("write"),
            (409, "The `Idempotency-Key` was used before with a different body."),
            (413, f"The body is longer than {config['MAX_CONTENT_LENGTH']} bytes."),
            (415, "The body is not `application/json`."),
        ),
        parameters=[idempotency_key("pet")],
        request_body=json_body(
            "NewPet", "The new pet; `id` and any other unknown field are refused."
        ),
    )


@bp.operation("/pets", "post", "createPet", create_pet_operation)
@needs_scope("write")
def create_pet() -> Response:
    """createPet: store a NewPet, answer 201 with the Pet and its Location; Idempotency-Key aware."""
    body = body_as_json()
    new_pet = schemas.plain_new_pet(body) or validate(schemas.new_pet, body)
    key = idempotency.requested_key()

    def store(conn: Connection) -> Response:
        row = pet_sql.insert_pet(
            conn,
            name=new_pet["name"],
            category_id=new_pet["category_id"],
            status=new_pet.get("status"),
        )
        return json_response(
            row["pet"], 201, headers={"Location": f"{API_PREFIX}/pets/{row['id']}"}
        )

    conn = get_conn()
    with durable_write(conn):
        if key is None:
            return store(conn)
        return idempotency.once(conn, current_caller().key_id, key, new_pet, store)


def get_pet_operation(config: Mapping[str, Any]) -> dict[str, Any]:
    """getPet's Operation Object: deprecated, with its sunset from the settings."""
    sunset = http_date(config["SUNSET"])
    pet_id = {"type": "integer", "format": "int64"}
    return operation_object(
        "Get a pet (deprecated)",
        f"Deprecated: removed at its sunset, {sunset}; from then on it answers 410. Use "
        "`GET /pets` with the `status` filter instead. Every answer of the operation itself "
        "carries `Deprecation`, `Sunset` and a `Link` to it.",
        ok(200, "Pet", "The pet.", headers=DEPRECATION),
        errors(
            (404, "No pet has this id."),
            (410, f"The operation was removed at its sunset ({sunset})."),
            headers=DEPRECATION,
        ),
        parameters=[
            {
                "name": "petId",
                "in": "path",
                "required": True,
                "description": "Identifier of the pet. One that is not an int64 is a pet "
                "that does not exist (404).",
                "schema": pet_id,
            }
        ],
        sunset=config["SUNSET"],
    )


@functools.lru_cache(maxsize=8)
def deprecation_fields(deprecated_at: int, sunset: int) -> tuple[tuple[str, str], ...]:
    """getPet's Deprecation, Sunset and Link fields, made once per pair of settings (formatting
    the date took 4 µs of every request)."""
    return (
        ("Deprecation", f"@{deprecated_at}"),
        ("Sunset", http_date(sunset)),
        ("Link", f'<{API_PREFIX}/pets>; rel="successor-version"'),
    )


@bp.operation("/pets/<pet_id>", "get", "getPet", get_pet_operation)
def get_pet(pet_id: str) -> Response:
    """getPet (deprecated): one pet, with Deprecation, Sunset and a Link to its successor."""
    config = current_app.config
    headers = dict(deprecation_fields(config["DEPRECATED_AT"], config["SUNSET"]))
    if time.time() >= config["SUNSET"]:
        raise APIError(
            410,
            f"GET {API_PREFIX}/pets/{{petId}} was removed at its sunset; "
            f"use GET {API_PREFIX}/pets with the status filter.",
            headers=headers,
        )
    # Not an int64: no such pet (404), the same answer as for an id that does not exist.
    if not PET_ID.fullmatch(pet_id) or int(pet_id) > schemas.INT64_MAX:
        raise APIError(404, "No pet with this id.", headers=headers)
    pet = read_on_standby_if_any(pet_sql.find_pet, int(pet_id))
    if pet is None and current_app.config.get("READ_DATABASE_URL"):
        # Perhaps created a moment ago and not yet on the standby: the primary has the last word.
        pet = pet_sql.find_pet(get_conn(), int(pet_id))
    if pet is None:
        raise APIError(404, "No pet with this id.", headers=headers)
    return json_response(pet, headers=headers)
