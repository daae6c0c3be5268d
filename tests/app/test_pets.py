"""The pets API over HTTP: createPet, listPets and its pages, the deprecated getPet, and the error shape."""

from __future__ import annotations

import calendar
import io
import re
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from flask import Flask, g
from flask.testing import FlaskClient

from petstore import db, schemas
from tests.support.checks import assert_error, post_chunked

SUNSET_HTTP_DATE = "Thu, 05 Dec 2030 00:00:00 GMT"
SUNSET_UNIX = calendar.timegm((2030, 12, 5, 0, 0, 0))
NEXT_LINK = re.compile(r'<(?P<url>/v1/pets\?[^<>]+)>; rel="next"')
SUCCESSOR_LINK = re.compile(r'<(?P<url>/v1/pets(\?[^<>]*)?)>;\s*rel="successor-version"')
STATUS_CYCLE = (*schemas.PET_STATUSES, None)


def as_json(row: dict[str, Any]) -> dict[str, Any]:
    """A pets row as the API shows it: categoryId, and no status when none was stated."""
    pet = {"id": row["id"], "name": row["name"], "categoryId": row["category_id"]}
    if row["status"] is not None:
        pet["status"] = row["status"]
    return pet


def add_pets(
    conn: db.Connection, count: int, statuses: tuple[str | None, ...] = STATUS_CYCLE
) -> list[dict[str, Any]]:
    """Insert `count` pets cycling through `statuses`; return them as the API shows them, by id."""
    rows = [
        conn.execute(
            "insert into pets (name, category_id, status) values (%s, %s, %s)"
            " returning id, name, category_id, status",
            [f"pet {n}", 100 + n % 3, statuses[n % len(statuses)]],
        ).fetchone()
        for n in range(count)
    ]
    return [as_json(row) for row in rows if row is not None]


def next_url(response: Any) -> str | None:
    """The target of the response's Link rel="next", or None when there is no Link."""
    link = response.headers.get("Link")
    if link is None:
        return None
    match = NEXT_LINK.fullmatch(link)
    assert match, f"not a rel=next Link: {link!r}"
    return match["url"]


def walk(
    client: FlaskClient, url: str, headers: dict[str, str], max_pages: int
) -> list[list[dict[str, Any]]]:
    """Follow rel=next from `url` until a page has no Link; return the pages."""
    pages: list[list[dict[str, Any]]] = []
    next_page: str | None = url
    while next_page is not None:
        assert len(pages) < max_pages, "the Link chain does not end"
        response = client.get(next_page, headers=headers)
        assert response.status_code == 200
        page = response.get_json()
        pages.append(page)
        next_page = next_url(response)
        if next_page is not None:
            # The cursor is the id of the last pet shown.
            assert parse_qs(urlsplit(next_page).query)["after"] == [str(page[-1]["id"])]
    return pages


def assert_deprecated(response: Any, sunset_http_date: str = SUNSET_HTTP_DATE) -> None:
    """getPet's deprecation headers: Deprecation (RFC 9745), Sunset (RFC 8594), Link to the successor."""
    deprecation = response.headers.get("Deprecation", "")
    assert re.fullmatch(r"@[0-9]+", deprecation), deprecation
    assert int(deprecation[1:]) <= SUNSET_UNIX
    assert response.headers.get("Sunset") == sunset_http_date
    assert SUCCESSOR_LINK.search(response.headers.get("Link", "")), response.headers.get("Link")


# createPet


def test_create_pet_without_status_leaves_it_out(
    client: FlaskClient, auth_headers: dict[str, str], conn: db.Connection
) -> None:
    response = client.post("/v1/pets", json={"name": "Rex", "categoryId": 7}, headers=auth_headers)

    assert response.status_code == 201
    assert response.mimetype == "application/json"
    body = response.get_json()
    assert set(body) == {"id", "name", "categoryId"}
    assert body["name"] == "Rex" and body["categoryId"] == 7
    assert isinstance(body["id"], int)
    assert response.headers["Location"] == f"/v1/pets/{body['id']}"
    row = conn.execute(
        "select name, category_id, status from pets where id = %s", [body["id"]]
    ).fetchone()
    assert row == {"name": "Rex", "category_id": 7, "status": None}


@pytest.mark.parametrize("status", schemas.PET_STATUSES)
def test_create_pet_with_status(
    client: FlaskClient, auth_headers: dict[str, str], conn: db.Connection, status: str
) -> None:
    response = client.post(
        "/v1/pets", json={"name": "Tom", "categoryId": 2, "status": status}, headers=auth_headers
    )

    assert response.status_code == 201
    body = response.get_json()
    assert body == {"id": body["id"], "name": "Tom", "categoryId": 2, "status": status}
    assert response.headers["Location"] == f"/v1/pets/{body['id']}"
    row = conn.execute(
        "select status::text as status from pets where id = %s", [body["id"]]
    ).fetchone()
    assert row == {"status": status}


def test_created_pet_is_served_at_its_location(
    client: FlaskClient, auth_headers: dict[str, str]
) -> None:
    created = client.post(
        "/v1/pets", json={"name": "Łajka 🐕", "categoryId": -5}, headers=auth_headers
    )
    assert created.status_code == 201

    fetched = client.get(created.headers["Location"], headers=auth_headers)

    assert fetched.status_code == 200
    assert (
        fetched.get_json()
        == created.get_json()
        == {"id": created.get_json()["id"], "name": "Łajka 🐕", "categoryId": -5}
    )


def test_created_pets_get_distinct_increasing_ids(
    client: FlaskClient, auth_headers: dict[str, str]
) -> None:
    ids = [
        client.post(
            "/v1/pets", json={"name": f"p{n}", "categoryId": 1}, headers=auth_headers
        ).get_json()["id"]
        for n in range(3)
    ]

    assert ids == sorted(set(ids))


def test_create_accepts_json_with_charset(
    client: FlaskClient, auth_headers: dict[str, str]
) -> None:
    response = client.post(
        "/v1/pets",
        data=b'{"name": "Rex", "categoryId": 1}',
        content_type="application/json; charset=utf-8",
        headers=auth_headers,
    )

    assert response.status_code == 201
    assert response.get_json()["name"] == "Rex"


def test_create_accepts_a_body_exactly_at_the_cap(
    app: Flask, client: FlaskClient, auth_headers: dict[str, str]
) -> None:
    cap = app.config["MAX_CONTENT_LENGTH"]
    shell = b'{"name": "", "categoryId": 1}'
    body = shell.replace(b'""', b'"' + b"x" * (cap - len(shell)) + b'"')
    assert len(body) == cap

    response = client.post(
        "/v1/pets", data=body, content_type="application/json", headers=auth_headers
    )

    assert response.status_code == 201
    assert len(response.get_json()["name"]) == cap - len(shell)


@pytest.mark.parametrize(
    "size", [pytest.param("small", id="small"), pytest.param("cap", id="exactly-the-cap")]
)
def test_create_accepts_a_chunked_body_within_the_cap(
    app: Flask, client: FlaskClient, auth_headers: dict[str, str], size: str
) -> None:
    data = b'{"name": "Rex", "categoryId": 1}'
    if size == "cap":
        data += b" " * (app.config["MAX_CONTENT_LENGTH"] - len(data))

    # No Content-Length, as gunicorn passes a chunked body on.
    response = post_chunked(client, data, auth_headers)

    assert response.status_code == 201
    assert response.get_json()["name"] == "Rex"


# listPets


def test_list_is_empty_without_pets(client: FlaskClient, auth_headers: dict[str, str]) -> None:
    response = client.get("/v1/pets", headers=auth_headers)

    assert response.status_code == 200
    assert response.mimetype == "application/json"
    assert response.get_json() == []
    assert "Link" not in response.headers


def test_list_orders_by_id_ascending(
    client: FlaskClient, auth_headers: dict[str, str], conn: db.Connection
) -> None:
    expected = add_pets(conn, 6)

    response = client.get("/v1/pets", headers=auth_headers)

    assert response.status_code == 200
    assert response.get_json() == expected
    assert [pet["id"] for pet in expected] == sorted(pet["id"] for pet in expected)
    assert "Link" not in response.headers


def test_list_orders_by_id_even_when_rows_were_updated(
    client: FlaskClient, auth_headers: dict[str, str], conn: db.Connection
) -> None:
    expected = add_pets(conn, 5)
    # An update moves rows physically; the answer must still follow the ids.
    conn.execute(
        "update pets set name = name || ' (moved)' where id in (%s, %s)",
        [expected[0]["id"], expected[2]["id"]],
    )
    for n in (0, 2):
        expected[n]["name"] += " (moved)"

    response = client.get("/v1/pets", headers=auth_headers)

    assert response.get_json() == expected


def test_list_default_limit_is_20(
    client: FlaskClient, auth_headers: dict[str, str], conn: db.Connection
) -> None:
    expected = add_pets(conn, 25)

    response = client.get("/v1/pets", headers=auth_headers)

    assert response.status_code == 200
    assert response.get_json() == expected[:20]
    url = next_url(response)
    assert url is not None
    assert parse_qs(urlsplit(url).query) == {"limit": ["20"], "after": [str(expected[19]["id"])]}


@pytest.mark.parametrize(
    ("limit", "shown", "has_next"),
    [
        pytest.param(1, 1, True, id="1-of-5"),
        pytest.param(3, 3, True, id="3-of-5"),
        pytest.param(5, 5, True, id="5-of-5-full-page"),
        pytest.param(6, 5, False, id="6-of-5"),
        pytest.param(100, 5, False, id="100-of-5"),
    ],
)
def test_list_limit(
    client: FlaskClient,
    auth_headers: dict[str, str],
    conn: db.Connection,
    limit: int,
    shown: int,
    has_next: bool,
) -> None:
    expected = add_pets(conn, 5)

    response = client.get(f"/v1/pets?limit={limit}", headers=auth_headers)

    assert response.status_code == 200
    assert response.get_json() == expected[:shown]
    assert (next_url(response) is not None) is has_next


def test_list_limit_100_shows_100(
    client: FlaskClient, auth_headers: dict[str, str], conn: db.Connection
) -> None:
    expected = add_pets(conn, 101)

    response = client.get("/v1/pets?limit=100", headers=auth_headers)

    assert response.get_json() == expected[:100]
    assert next_url(response) is not None


@pytest.mark.parametrize("status", schemas.PET_STATUSES)
def test_list_filters_by_status(
    client: FlaskClient, auth_headers: dict[str, str], conn: db.Connection, status: str
) -> None:
    everything = add_pets(conn, 12)

    response = client.get(f"/v1/pets?status={status}", headers=auth_headers)

    assert response.status_code == 200
    assert response.get_json() == [pet for pet in everything if pet.get("status") == status]
    assert len(response.get_json()) == 3
    assert "Link" not in response.headers


def test_list_status_filter_with_no_match_is_empty(
    client: FlaskClient, auth_headers: dict[str, str], conn: db.Connection
) -> None:
    add_pets(conn, 4, statuses=("available", None))

    response = client.get("/v1/pets?status=sold", headers=auth_headers)

    assert response.status_code == 200
    assert response.get_json() == []


@pytest.mark.parametrize(
    ("count", "limit", "status"),
    [
        pytest.param(13, 4, None, id="13-by-4"),
        pytest.param(12, 4, None, id="12-by-4-last-page-full"),
        pytest.param(45, 20, None, id="45-by-default-20"),
        pytest.param(1, 1, None, id="1-by-1"),
        pytest.param(30, 2, "sold", id="sold-by-2"),
        pytest.param(29, 3, "available", id="available-by-3"),
    ],
)
def test_following_next_links_shows_every_pet_exactly_once(
    client: FlaskClient,
    auth_headers: dict[str, str],
    conn: db.Connection,
    count: int,
    limit: int,
    status: str | None,
) -> None:
    everything = add_pets(conn, count)
    expected = [pet for pet in everything if status is None or pet.get("status") == status]
    query = f"?limit={limit}" if limit != 20 else ""
    if status is not None:
        query += ("&" if query else "?") + f"status={status}"

    pages = walk(client, f"/v1/pets{query}", auth_headers, max_pages=count + 2)

    shown = [pet for page in pages for pet in page]
    assert shown == expected
    assert all(len(page) == limit for page in pages[:-1])
    assert len(pages) == len(expected) // limit + 1


def test_next_link_keeps_the_status_filter(
    client: FlaskClient, auth_headers: dict[str, str], conn: db.Connection
) -> None:
    add_pets(conn, 8)

    response = client.get("/v1/pets?status=pending&limit=1", headers=auth_headers)

    url = next_url(response)
    assert url is not None
    query = parse_qs(urlsplit(url).query)
    assert query["status"] == ["pending"]
    assert query["limit"] == ["1"]


def test_pages_do_not_repeat_a_pet_created_meanwhile(
    client: FlaskClient, auth_headers: dict[str, str], conn: db.Connection
) -> None:
    first = add_pets(conn, 4)
    page_one = client.get("/v1/pets?limit=2", headers=auth_headers)
    later = add_pets(conn, 1)

    url = next_url(page_one)
    assert url is not None
    rest = walk(client, url, auth_headers, max_pages=5)

    assert page_one.get_json() + [pet for page in rest for pet in page] == first + later


# getPet (deprecated)


def test_get_pet(client: FlaskClient, auth_headers: dict[str, str], conn: db.Connection) -> None:
    pet, unstated = add_pets(conn, 2, statuses=("sold", None))

    response = client.get(f"/v1/pets/{pet['id']}", headers=auth_headers)
    without_status = client.get(f"/v1/pets/{unstated['id']}", headers=auth_headers)

    assert response.status_code == 200
    assert response.mimetype == "application/json"
    assert (
        response.get_json()
        == pet
        == {"id": pet["id"], "name": "pet 0", "categoryId": 100, "status": "sold"}
    )
    assert_deprecated(response)
    assert without_status.get_json() == unstated
    assert "status" not in without_status.get_json()


def test_get_pet_links_to_its_successor(
    client: FlaskClient, auth_headers: dict[str, str], conn: db.Connection
) -> None:
    (pet,) = add_pets(conn, 1)

    response = client.get(f"/v1/pets/{pet['id']}", headers=auth_headers)

    match = SUCCESSOR_LINK.search(response.headers["Link"])
    assert match
    successor = client.get(match["url"], headers=auth_headers)
    assert successor.status_code == 200
    assert successor.get_json() == [pet]


def test_get_missing_pet_is_404_with_deprecation_headers(
    client: FlaskClient, auth_headers: dict[str, str], conn: db.Connection
) -> None:
    (pet,) = add_pets(conn, 1)

    response = client.get(f"/v1/pets/{pet['id'] + 1}", headers=auth_headers)

    assert_error(response, 404, "not_found")
    assert_deprecated(response)


@pytest.mark.parametrize(
    "seconds_ago", [pytest.param(0, id="at-the-sunset"), pytest.param(86400, id="after")]
)
def test_get_pet_is_gone_from_the_sunset_on(
    make_app: Callable[..., Flask],
    auth_headers: dict[str, str],
    conn: db.Connection,
    seconds_ago: int,
) -> None:
    (pet,) = add_pets(conn, 1)
    sunset = int(time.time()) - seconds_ago
    client = make_app(SUNSET=sunset).test_client()

    existing = client.get(f"/v1/pets/{pet['id']}", headers=auth_headers)
    missing = client.get(f"/v1/pets/{pet['id'] + 1}", headers=auth_headers)

    for response in (existing, missing):
        assert_error(response, 410, "gone")
        assert_deprecated(response, time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(sunset)))


def test_get_pet_still_answers_before_a_moved_sunset(
    make_app: Callable[..., Flask], auth_headers: dict[str, str], conn: db.Connection
) -> None:
    (pet,) = add_pets(conn, 1)
    sunset = int(time.time()) + 3600
    client = make_app(SUNSET=sunset).test_client()

    response = client.get(f"/v1/pets/{pet['id']}", headers=auth_headers)

    assert response.status_code == 200
    assert response.get_json() == pet
    assert_deprecated(response, time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(sunset)))


def test_sunset_does_not_touch_the_other_operations(
    make_app: Callable[..., Flask], auth_headers: dict[str, str]
) -> None:
    client = make_app(SUNSET=int(time.time()) - 60).test_client()

    assert client.get("/v1/pets", headers=auth_headers).status_code == 200
    assert (
        client.post(
            "/v1/pets", json={"name": "a", "categoryId": 1}, headers=auth_headers
        ).status_code
        == 201
    )


# Other endpoints


def test_store_orders_is_not_implemented(client: FlaskClient, auth_headers: dict[str, str]) -> None:
    response = client.get("/v1/store/orders", headers=auth_headers)

    assert_error(response, 501, "not_implemented")


def test_healthz_needs_no_key(client: FlaskClient) -> None:
    response = client.get("/healthz")

    assert response.status_code == 200
    assert response.mimetype == "application/json"
    assert response.get_json()["status"] == "ok"  # and the version: test_versions.py


# Errors of the routing layer


@pytest.mark.parametrize(
    ("path", "with_key"),
    [
        pytest.param("/v1/nope", True, id="v1-unknown"),
        pytest.param("/v1/pets/1/extra", True, id="v1-below-a-pet"),
        pytest.param("/v1/pets/", True, id="v1-trailing-slash"),
        pytest.param("/v1/store", True, id="v1-store"),
        pytest.param("/v2/pets", True, id="v2"),
        pytest.param("/pets", False, id="unversioned"),
        pytest.param("/", False, id="root"),
        pytest.param("/nope", False, id="outside-v1"),
        pytest.param("/nope", True, id="outside-v1-with-key"),
    ],
)
def test_unknown_path_is_404_json(
    client: FlaskClient, auth_headers: dict[str, str], path: str, with_key: bool
) -> None:
    response = client.get(path, headers=auth_headers if with_key else {})

    assert_error(response, 404, "not_found")


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        pytest.param("DELETE", "/v1/pets", {"GET", "POST"}, id="delete-pets"),
        pytest.param("PUT", "/v1/pets", {"GET", "POST"}, id="put-pets"),
        pytest.param("PUT", "/v1/pets/1", {"GET"}, id="put-pet"),
        pytest.param("DELETE", "/v1/pets/1", {"GET"}, id="delete-pet"),
        pytest.param("PATCH", "/v1/pets/1", {"GET"}, id="patch-pet"),
        pytest.param("POST", "/v1/store/orders", {"GET"}, id="post-orders"),
        pytest.param("POST", "/healthz", {"GET"}, id="post-healthz"),
    ],
)
def test_wrong_method_is_405_json_with_allow(
    client: FlaskClient,
    auth_headers: dict[str, str],
    conn: db.Connection,
    method: str,
    path: str,
    allowed: set[str],
) -> None:
    response = client.open(path, method=method, headers=auth_headers)

    assert_error(response, 405, "method_not_allowed")
    allow = {name.strip() for name in response.headers["Allow"].split(",")}
    assert allowed <= allow
    assert method not in allow
    assert allow <= {"GET", "HEAD", "POST"}


def test_unexpected_failure_is_500_without_details(
    make_app: Callable[..., Flask], auth_headers: dict[str, str]
) -> None:
    app = make_app()

    @app.get("/v1/boom")
    def boom() -> str:
        raise RuntimeError("secret detail: select key_hash from api_keys")

    response = app.test_client().get("/v1/boom", headers=auth_headers)

    body = assert_error(response, 500, "internal_error")
    text = response.get_data(as_text=True)
    for leak in ("secret", "select", "Traceback", "RuntimeError", "boom", ".py"):
        assert leak not in text
    assert set(body) == {"code", "message", "status"}


def test_the_body_is_read_before_a_pooled_connection_is_taken(
    client: FlaskClient, auth_headers: dict[str, str]
) -> None:
    """A slow body holds a thread, never a PostgreSQL connection (the key lookup takes one)."""
    holding_a_connection: list[bool] = []

    class Body(io.BytesIO):
        def read(self, size: int | None = -1, /) -> bytes:
            holding_a_connection.append("conn" in g)
            return super().read(size)

        def readinto(self, buffer: Any, /) -> int:
            holding_a_connection.append("conn" in g)
            return super().readinto(buffer)

    data = b'{"name": "Rex", "categoryId": 1}'
    response = client.post(
        "/v1/pets",
        input_stream=Body(data),
        content_type="application/json",
        content_length=len(data),
        headers=auth_headers,
    )
    assert response.status_code == 201, response.get_data(as_text=True)
    assert holding_a_connection and not any(holding_a_connection)
