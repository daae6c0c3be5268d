"""The pets resource: list, create, and the deprecated get-one; each view routed with its Operation Object."""

from __future__ import annotations

import functools
import time

from flask import Response, current_app
from werkzeug.http import http_date

from petstore import idempotency, openapi, schemas
from petstore.auth import current_caller, needs_scope
from petstore.db import Connection, get_conn
from petstore.durable import durable_write
from petstore.errors import APIError
from petstore.queries import pets as pet_sql
from petstore.standbys import read_on_standby_if_any
from petstore.web import API_PREFIX, body_as_json, json_response, validate, validate_query

# getPet's Link to the operation that replaces it.
SUCCESSOR = f'<{API_PREFIX}/pets>; rel="successor-version"'


def header_components(config: openapi.Settings) -> dict[str, openapi.Object]:
    """The headers of the pets' responses by component id: Location, replays, pages, deprecation."""
    text = {"type": "string"}
    return {
        "Location": openapi.header("The path of the new pet.", {**text, "example": "/v1/pets/1"}),
        **openapi.idempotent_replayed(),
        "NextPage": openapi.header(
            'The next page, on full pages only: `<url>; rel="next"` (RFC 8288); its '
            "`after` parameter is the id of the last pet of this page.",
            {**text, "example": '</v1/pets?limit=20&after=20>; rel="next"'},
            required=False,
        ),
        **openapi.deprecation_headers(
            config["DEPRECATED_AT"],
            config["SUNSET"],
            "`GET /v1/pets` (with the `status` filter)",
            SUCCESSOR,
        ),
    }


bp = openapi.Resource(
    "pets",
    __name__,
    tag="pets",
    tag_description="The animals of the catalogue.",
    schemas={"NewPet": schemas.NewPetSchema, "Pet": schemas.PetSchema},
    headers=header_components,
)


def list_pets_operation(config: openapi.Settings) -> openapi.Object:
    """listPets' Operation Object."""
    return openapi.operation_object(
        "List pets",
        "Pets by id ascending, at most `limit` of them, optionally only those of one `status`. "
        'A full page carries `Link: <...>; rel="next"` to the next one (a keyset cursor, '
        "`after`). Unknown query parameters are refused (400).",
        openapi.ok(200, "Pet", "A page of pets.", many=True, headers={"Link": "NextPage"}),
        openapi.errors(400),
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


def create_pet_operation(config: openapi.Settings) -> openapi.Object:
    """createPet's Operation Object."""
    new_pet = {"operationId": "getPet", "parameters": {"petId": "$response.body#/id"}}
    return openapi.operation_object(
        "Add a pet",
        "Stores a NewPet and answers the Pet with its new `id`. A `status` left out stays "
        "unstated (it is not defaulted).",
        openapi.ok(
            201,
            "Pet",
            "Created; `Location` is the new pet's path. A repeat with the same "
            "`Idempotency-Key` replays this first response.",
            headers=("Location", "Idempotent-Replayed"),
            links={"GetPetById": {**new_pet, "description": "The new pet, by its `id`."}},
        ),
        openapi.errors(
            400,
            openapi.lacks_scope("write"),
            (409, "The `Idempotency-Key` was used before with a different body."),
            (413, f"The body is longer than {config['MAX_CONTENT_LENGTH']} bytes."),
            (415, "The body is not `application/json`."),
        ),
        parameters=[openapi.idempotency_key("pet")],
        request_body=openapi.json_body(
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


def get_pet_operation(config: openapi.Settings) -> openapi.Object:
    """getPet's Operation Object: deprecated, with its sunset from the settings."""
    sunset = http_date(config["SUNSET"])
    pet_id = openapi.path_parameter(
        "petId",
        "Identifier of the pet. One that is not an int64 is a pet that does not exist (404).",
        {"type": "integer", "format": "int64"},
    )
    return openapi.operation_object(
        "Get a pet (deprecated)",
        f"Deprecated: removed at its sunset, {sunset}; from then on it answers 410. Use "
        "`GET /pets` with the `status` filter instead. Every answer of the operation itself "
        "carries `Deprecation`, `Sunset` and a `Link` to it.",
        openapi.ok(200, "Pet", "The pet.", headers=openapi.DEPRECATION),
        openapi.errors(
            (404, "No pet has this id."),
            (410, f"The operation was removed at its sunset ({sunset})."),
            headers=openapi.DEPRECATION,
        ),
        parameters=[pet_id],
        sunset=config["SUNSET"],
    )


@functools.lru_cache(maxsize=8)
def deprecation_fields(deprecated_at: int, sunset: int) -> tuple[tuple[str, str], ...]:
    """getPet's Deprecation, Sunset and Link fields, made once: formatting took 4 µs a request."""
    return (
        ("Deprecation", f"@{deprecated_at}"),
        ("Sunset", http_date(sunset)),
        ("Link", SUCCESSOR),
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
    if not schemas.DIGITS.fullmatch(pet_id) or int(pet_id) > schemas.INT64_MAX:
        raise APIError(404, "No pet with this id.", headers=headers)
    pet = read_on_standby_if_any(pet_sql.find_pet, int(pet_id))
    if pet is None and current_app.config.get("READ_DATABASE_URL"):
        # Perhaps created a moment ago and not yet on the standby: the primary has the last word.
        pet = pet_sql.find_pet(get_conn(), int(pet_id))
    if pet is None:
        raise APIError(404, "No pet with this id.", headers=headers)
    return json_response(pet, headers=headers)
