"""The pets resource: list, create, and the deprecated get-one."""

from __future__ import annotations

import time

from flask import Blueprint, Response, current_app
from werkzeug.http import http_date

from petstore import idempotency, schemas
from petstore.auth import needs_scope
from petstore.db import Connection, get_conn
from petstore.errors import APIError
from petstore.queries import pets
from petstore.web import json_body, json_response, validate, validate_query

bp = Blueprint("pets", __name__)

PET_ID = schemas.DIGITS


@bp.get("/pets")
def list_pets() -> Response:
    """listPets: one page by id ascending; a Link rel=next when the page is full."""
    query = validate_query(schemas.list_pets_query)
    status = query.get("status")
    if status is None:
        page = pets.list_pets(get_conn(), after=query["after"], limit=query["limit"])
    else:
        page = pets.list_pets_by_status(
            get_conn(), status=status, after=query["after"], limit=query["limit"]
        )
    headers = {}
    if page["count"] == query["limit"]:
        # Digits, and a status from PET_STATUSES: nothing to percent-encode.
        following = f"limit={query['limit']}&after={page['last_id']}"
        if status is not None:
            following += f"&status={status}"
        headers["Link"] = f'</v1/pets?{following}>; rel="next"'
    return json_response(page["pets"], headers=headers)


@bp.post("/pets")
@needs_scope("write")
def create_pet() -> Response:
    """createPet: store a NewPet, answer 201 with the Pet and its Location; Idempotency-Key aware."""
    new_pet = validate(schemas.new_pet, json_body())
    key = idempotency.requested_key()

    def store(conn: Connection) -> Response:
        row = pets.insert_pet(
            conn,
            name=new_pet["name"],
            category_id=new_pet["category_id"],
            status=new_pet.get("status"),
        )
        return json_response(row["pet"], 201, headers={"Location": f"/v1/pets/{row['id']}"})

    if key is None:
        return store(get_conn())
    return idempotency.once(get_conn(), key, new_pet, store)


@bp.get("/pets/<pet_id>")
def get_pet(pet_id: str) -> Response:
    """getPet (deprecated): one pet, with Deprecation, Sunset and a Link to its successor."""
    config = current_app.config
    headers = {
        "Deprecation": f"@{config['DEPRECATED_AT']}",
        "Sunset": http_date(config["SUNSET"]),
        "Link": '</v1/pets>; rel="successor-version"',
    }
    if time.time() >= config["SUNSET"]:
        raise APIError(
            410,
            "GET /v1/pets/{petId} was removed at its sunset; use GET /v1/pets with the status filter.",
            headers=headers,
        )
    # Not an int64: no such pet (404), the same answer as for an id that does not exist.
    if not PET_ID.fullmatch(pet_id) or int(pet_id) > schemas.INT64_MAX:
        raise APIError(404, "No pet with this id.", headers=headers)
    pet = pets.find_pet(get_conn(), int(pet_id))
    if pet is None:
        raise APIError(404, "No pet with this id.", headers=headers)
    return json_response(pet, headers=headers)
