"""The floor: the least work that answers the benchmark's requests on the service's own stack.

No Flask, no marshmallow, no limiter, no request log: parse the bearer token, look the key up with
the service's query, run the service's SQL for the operation (the functions of petstore.queries),
write the same JSON and headers, on a pool made as the service makes its own (petstore.db.open_pool).
Served by the same gunicorn config as the service:

    gunicorn -c deploy/gunicorn.conf.py --pythonpath bench floor:app
"""

from __future__ import annotations

import email.utils
import json
import re
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import parse_qsl, urlencode

from petstore import config, db
from petstore.auth import hash_key
from petstore.queries import keys, pets

StartResponse = Callable[[str, list[tuple[str, str]]], Any]
WSGIApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]

PET_PATH = re.compile(r"/v1/pets/([0-9]{1,18})")
STATUSES = ("available", "pending", "sold")


# --- JSON: the one place that knows what petstore.queries returns --------------------------------
# Either rows as dicts (id, name, category_id, status), written here as the Pet schema does, or
# JSON text that PostgreSQL wrote (a page {"pets", "count", "last_id"}, a pet's text, {"id", "pet"}),
# sent as it comes, like the service does. When the queries change shape again, change these two
# functions; the runner compares the floor's answers with the service's before measuring.


def shown(row: dict[str, Any]) -> dict[str, Any]:
    """A pets row as the API shows it: categoryId, and no status when it is NULL."""
    pet = {"id": row["id"], "name": row["name"], "categoryId": row["category_id"]}
    if row["status"] is not None:
        pet["status"] = row["status"]
    return pet


def page_json(result: Any) -> tuple[bytes, int, int | None]:
    """(body, pets on the page, id of the last one) of what a list query returned."""
    if isinstance(result, dict):
        return result["pets"].encode(), result["count"], result["last_id"]
    last_id = result[-1]["id"] if result else None
    return json.dumps([shown(row) for row in result]).encode(), len(result), last_id


def pet_json(result: Any) -> tuple[bytes, int | None]:
    """(body, id) of what find_pet or insert_pet returned (id None when only the text came back)."""
    if isinstance(result, str):
        return result.encode(), None
    if "pet" in result:
        return result["pet"].encode(), result["id"]
    return json.dumps(shown(result)).encode(), result["id"]


def respond(
    start_response: StartResponse,
    status: str,
    body: bytes,
    headers: list[tuple[str, str]] | None = None,
) -> list[bytes]:
    """Start a JSON response with a Content-Length, as the service sends."""
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


def create_floor() -> WSGIApp:
    """The floor WSGI app, with its own pool (created in each worker: gunicorn imports us after fork)."""
    settings = config.from_environ()
    config.check(settings)
    pool = db.open_pool(settings, name="floor")
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
        if not 1 <= limit <= 100 or after < 0 or status not in (None, *STATUSES):
            return error(sr, 400, "invalid_request")
        if status is None:
            result = pets.list_pets(conn, after=after, limit=limit)
        else:
            result = pets.list_pets_by_status(conn, status=status, after=after, limit=limit)
        body, count, last_id = page_json(result)
        headers = []
        if count == limit:
            params: dict[str, Any] = {"limit": limit, "after": last_id}
            if status is not None:
                params["status"] = status
            headers.append(("Link", f'</v1/pets?{urlencode(params)}>; rel="next"'))
        return respond(sr, "200 OK", body, headers)

    def create_pet(conn: db.Connection, environ: dict[str, Any], sr: StartResponse) -> list[bytes]:
        length = int(environ.get("CONTENT_LENGTH") or 0)
        try:
            new_pet = json.loads(environ["wsgi.input"].read(length))
            name, category_id = new_pet["name"], new_pet["categoryId"]
        except (ValueError, KeyError, TypeError):
            return error(sr, 400, "invalid_request")
        result = pets.insert_pet(
            conn, name=name, category_id=category_id, status=new_pet.get("status")
        )
        body, pet_id = pet_json(result)
        return respond(sr, "201 CREATED", body, [("Location", f"/v1/pets/{pet_id}")])

    def get_pet(conn: db.Connection, pet_id: int, sr: StartResponse) -> list[bytes]:
        result = pets.find_pet(conn, pet_id)
        if result is None:
            return error(sr, 404, "not_found")
        return respond(sr, "200 OK", pet_json(result)[0], get_pet_headers)

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
            match = PET_PATH.fullmatch(path)
            if match is not None and method == "GET":
                return get_pet(conn, int(match[1]), sr)
        return error(sr, 404, "not_found")

    return app


app = create_floor()
