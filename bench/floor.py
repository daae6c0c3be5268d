"""The floor: the least work that answers the benchmark's requests on the service's own stack.

No Flask, no marshmallow, no limiter, no request log: parse the bearer token, look the key up with
the service's query, run the service's SQL for the operation (the functions of petstore.queries),
write the same JSON and headers, on a pool made as the service makes its own (petstore.db.open_pool).
Served by the same gunicorn config as the service:

    gunicorn -c deploy/gunicorn.conf.py 'bench.floor:create_floor()'
"""

from __future__ import annotations

import email.utils
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from urllib.parse import parse_qsl, urlencode

from psycopg_pool import ConnectionPool

from petstore import config, db
from petstore.keys import hash_key
from petstore.queries import keys, pets
from petstore.schemas import DIGITS, INT64_MAX, PET_STATUSES

StartResponse = Callable[[str, list[tuple[str, str]]], Any]
WSGIApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]

PET_PATH = "/v1/pets/"


def respond(
    start_response: StartResponse,
    status: str,
    body: bytes,
    headers: list[tuple[str, str]] | None = None,
) -> list[bytes]:
    """Start a JSON response with a Content-Length, as the service sends (a newline at its end)."""
    body += b"\n"
    start_response(
        status,
        [
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(body))),
            *(headers or []),
        ],
    )
    return [body]


def error(start_response: StartResponse, code: int, reason: str) -> list[bytes]:
    """An error in the service's Error shape (no detail: the floor only needs the status)."""
    body = json.dumps({"code": reason, "message": reason, "status": code}).encode()
    return respond(start_response, f"{code} {reason.upper()}", body)


def create_floor(
    settings: Mapping[str, Any] | None = None, pool: ConnectionPool[db.Connection] | None = None
) -> WSGIApp:
    """The floor WSGI app: settings from the environment unless given, its own pool unless given.

    gunicorn calls it in each worker (`bench.floor:create_floor()`), after the fork.
    """
    settings = config.from_environ() if settings is None else settings
    config.check(settings)
    pool = db.open_pool(settings, name="floor") if pool is None else pool
    get_pet_headers = [
        ("Deprecation", f"@{settings['DEPRECATED_AT']}"),
        ("Sunset", email.utils.formatdate(settings["SUNSET"], usegmt=True)),
        ("Link", '</v1/pets>; rel="successor-version"'),
    ]

    def list_pets(conn: db.Connection, environ: dict[str, Any], sr: StartResponse) -> list[bytes]:
        query = dict(parse_qsl(environ.get("QUERY_STRING", "")))
        try:
            limit = int(query.get("limit", 20))
            after = int(query.get("after", 0))
        except ValueError:
            return error(sr, 400, "invalid_request")
        status = query.get("status")
        if not 1 <= limit <= 100 or after < 0 or status not in (None, *PET_STATUSES):
            return error(sr, 400, "invalid_request")
        if status is None:
            result = pets.list_pets(conn, after=after, limit=limit)
        else:
            result = pets.list_pets_by_status(conn, status=status, after=after, limit=limit)
        headers = []
        if result["count"] == limit:
            params: dict[str, Any] = {"limit": limit, "after": result["last_id"]}
            if status is not None:
                params["status"] = status
            headers.append(("Link", f'</v1/pets?{urlencode(params)}>; rel="next"'))
        return respond(sr, "200 OK", result["pets"].encode(), headers)

    def create_pet(conn: db.Connection, environ: dict[str, Any], sr: StartResponse) -> list[bytes]:
        length = int(environ.get("CONTENT_LENGTH") or 0)
        try:
            new_pet = json.loads(environ["wsgi.input"].read(length))
            name, category_id = new_pet["name"], new_pet["categoryId"]
        except (ValueError, KeyError, TypeError):
            return error(sr, 400, "invalid_request")
        row = pets.insert_pet(
            conn, name=name, category_id=category_id, status=new_pet.get("status")
        )
        location = [("Location", f"/v1/pets/{row['id']}")]
        return respond(sr, "201 CREATED", row["pet"].encode(), location)

    def get_pet(conn: db.Connection, pet_id: int, sr: StartResponse) -> list[bytes]:
        pet = pets.find_pet(conn, pet_id)
        if pet is None:
            return error(sr, 404, "not_found")
        return respond(sr, "200 OK", pet.encode(), get_pet_headers)

    def app(environ: dict[str, Any], sr: StartResponse) -> list[bytes]:
        path, method = environ["PATH_INFO"], environ["REQUEST_METHOD"]
        if path == "/healthz":
            return respond(sr, "200 OK", b'{"status": "ok"}')
        parts = environ.get("HTTP_AUTHORIZATION", "").split()
        if len(parts) != 2 or parts[0].lower() != "bearer":
            return error(sr, 401, "unauthorized")
        with pool.connection() as conn:
            caller = keys.find_key_by_hash(conn, hash_key(parts[1]))
            if caller is None:
                return error(sr, 401, "unauthorized")
            if caller["banned_until"] is not None:
                return error(sr, 429, "api_key_banned")
            if path == "/v1/pets" and method == "GET":
                return list_pets(conn, environ, sr)
            if path == "/v1/pets" and method == "POST":
                return create_pet(conn, environ, sr)
            pet_id = path.removeprefix(PET_PATH)
            if path.startswith(PET_PATH) and DIGITS.fullmatch(pet_id) and method == "GET":
                if int(pet_id) <= INT64_MAX:
                    return get_pet(conn, int(pet_id), sr)
        return error(sr, 404, "not_found")

    return app
