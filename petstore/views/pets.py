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
    JSON,
    Resource,
    common_responses,
    error_response_object,
    rate_limit_headers,
)
from petstore.queries import pets as pet_sql
from petstore.standbys import read_on_standby_if_any
from petstore.web import API_PREFIX, body_as_json, json_response, validate, validate_query


def header_components(config: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The headers of the pets' responses, by component id: Location, the replay flag, the next
    page, and getPet's deprecation."""
    return {
        "Location": {
            "description": "The path of the new pet.",
            "required": True,
            "schema": {"type": "string", "example": "/v1/pets/1"},
        },
        "Idempotent-Replayed": {
            "description": "`true` when this is the stored first response to an earlier request "
            "with the same `Idempotency-Key`, replayed.",
            "required": False,
            "schema": {"type": "string", "enum": ["true"]},
        },
        "NextPage": {
            "description": 'The next page, on full pages only: `<url>; rel="next"` (RFC 8288); its '
            "`after` parameter is the id of the last pet of this page.",
            "required": False,
            "schema": {"type": "string", "example": '</v1/pets?limit=20&after=20>; rel="next"'},
        },
        "Deprecation": {
            "description": "When this operation became deprecated (RFC 9745): `@` and unix seconds.",
            "required": True,
            "schema": {
                "type": "string",
                "pattern": "^@-?[0-9]+$",
                "example": f"@{config['DEPRECATED_AT']}",
            },
        },
        "Sunset": {
            "description": "When this operation goes away (RFC 8594), as an HTTP date.",
            "required": True,
            "schema": {"type": "string", "example": http_date(config["SUNSET"])},
        },
        "SuccessorLink": {
            "description": "The replacement: `GET /v1/pets` (with the `status` filter).",
            "required": True,
            "schema": {"type": "string", "example": '</v1/pets>; rel="successor-version"'},
        },
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


def deprecation_headers() -> dict[str, str]:
    """getPet's Deprecation, Sunset and successor Link headers (the response header name -> component id)."""
    return {"Deprecation": "Deprecation", "Sunset": "Sunset", "Link": "SuccessorLink"}


def deprecated_error(status: int, description: str) -> dict[str, Any]:
    """An Error response of getPet itself, with its deprecation headers."""
    response = error_response_object(status, description)
    response["headers"].update(deprecation_headers())
    return response


def list_pets_operation(config: Mapping[str, Any]) -> dict[str, Any]:
    """listPets' Operation Object."""
    return {
        "summary": "List pets",
        "description": "Pets by id ascending, at most `limit` of them, optionally only "
        'those of one `status`. A full page carries `Link: <...>; rel="next"` to the '
        "next one (a keyset cursor, `after`). Unknown query parameters are refused (400).",
        "parameters": [{"in": "query", "schema": schemas.ListPetsQuery}],
        "responses": {
            "200": {
                "description": "A page of pets.",
                "headers": {**rate_limit_headers(), "Link": "NextPage"},
                "content": {JSON: {"schema": {"type": "array", "items": "Pet"}}},
            },
            "400": "BadRequest",
            **common_responses(),
        },
    }


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
    return {
        "summary": "Add a pet",
        "description": "Stores a NewPet and answers the Pet with its new `id`. A `status` "
        "left out stays unstated (it is not defaulted).",
        "parameters": [idempotency_key_parameter()],
        "requestBody": {
            "required": True,
            "description": "The new pet; `id` and any other unknown field are refused.",
            "content": {JSON: {"schema": "NewPet"}},
        },
        "responses": {
            "201": {
                "description": "Created; `Location` is the new pet's path. A repeat with "
                "the same `Idempotency-Key` replays this first response.",
                "headers": {
                    **rate_limit_headers(),
                    "Location": "Location",
                    "Idempotent-Replayed": "Idempotent-Replayed",
                },
                "content": {JSON: {"schema": "Pet"}},
                "links": {
                    "GetPetById": {
                        "operationId": "getPet",
                        "parameters": {"petId": "$response.body#/id"},
                        "description": "The new pet, by its `id`.",
                    }
                },
            },
            "400": "BadRequest",
            "403": error_response_object(
                403,
                "The API key lacks the `write` scope (a read-only key); "
                '`WWW-Authenticate` says `error="insufficient_scope", scope="write"`.',
                ("WWW-Authenticate",),
            ),
            "409": error_response_object(
                409, "The `Idempotency-Key` was used before with a different body."
            ),
            "413": error_response_object(
                413,
                f"The body is longer than {config['MAX_CONTENT_LENGTH']} bytes.",
            ),
            "415": error_response_object(415, "The body is not `application/json`."),
            **common_responses(),
        },
    }


def idempotency_key_parameter() -> dict[str, Any]:
    """The optional Idempotency-Key header of createPet (Stripe's semantics)."""
    return {
        "name": "Idempotency-Key",
        "in": "header",
        "required": False,
        "description": "Makes a retried POST safe: the first response for a key (and API key) is "
        "stored for 24 hours and replayed, with `Idempotent-Replayed: true`, to every repeat with "
        "the same body, instead of creating a second pet. A repeat sent while the first request "
        "is still running waits for it and gets the replay. The same key with a different body "
        "answers 409 `idempotency_key_reused`. 1 to 255 printable ASCII characters (a UUID "
        "fits); a malformed key answers 400.",
        "schema": {
            "type": "string",
            "minLength": 1,
            "maxLength": 255,
            "pattern": "^[\\x21-\\x7e]([\\x20-\\x7e]*[\\x21-\\x7e])?$",
            "example": "5f0c8a52-4a3b-4d39-9d2b-1c1f0e6b7a10",
        },
    }


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
    sunset_day = time.strftime("%Y-%m-%d", time.gmtime(config["SUNSET"]))
    return {
        "summary": "Get a pet (deprecated)",
        "description": f"Deprecated: removed at its sunset, {sunset}; from then on it "
        "answers 410. Use `GET /pets` with the `status` filter instead. Every answer "
        "of the operation itself carries `Deprecation`, `Sunset` and a `Link` to it.",
        "deprecated": True,
        "x-sunset": sunset_day,
        "parameters": [
            {
                "name": "petId",
                "in": "path",
                "required": True,
                "description": "Identifier of the pet. One that is not an int64 is a pet "
                "that does not exist (404).",
                "schema": {"type": "integer", "format": "int64"},
            }
        ],
        "responses": {
            "200": {
                "description": "The pet.",
                "headers": {**rate_limit_headers(), **deprecation_headers()},
                "content": {JSON: {"schema": "Pet"}},
            },
            "404": deprecated_error(404, "No pet has this id."),
            "410": deprecated_error(410, f"The operation was removed at its sunset ({sunset})."),
            **common_responses(),
        },
    }


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
