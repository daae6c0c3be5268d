"""Bad input gets a clear 4xx Error, never a 500, and leaves the pets table as it was."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient

from petstore import db
from petstore.queries import pets
from tests.conftest import count_pets
from tests.support.checks import assert_error, post_chunked

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)
VALID = {"name": "Rex", "categoryId": 1}


def body(**changes: Any) -> bytes:
    """A NewPet as JSON bytes: VALID with `changes` applied (a value of ... removes the field)."""
    pet = {**VALID, **changes}
    return json.dumps({name: value for name, value in pet.items() if value is not ...}).encode()


def table(conn: db.Connection) -> list[dict[str, Any]]:
    """Every row of pets, to compare before and after a request."""
    return conn.execute("select * from pets order by id").fetchall()


@pytest.fixture
def seeded(conn: db.Connection) -> list[dict[str, Any]]:
    """Two pets, so that 'unchanged' is not just 'still empty'."""
    pets.insert_pet(conn, name="Rex", category_id=1, status="available")
    pets.insert_pet(conn, name="Tom", category_id=2, status=None)
    return table(conn)


JSON = "application/json"


def invalid(case: str, data: bytes, field: str | None = None) -> Any:
    """A JSON body refused with 400 invalid_request, naming `field` in `errors` when given."""
    return pytest.param(data, JSON, 400, "invalid_request", field, id=case)


def unsupported(case: str, data: bytes, content_type: str | None) -> Any:
    """A body refused with 415 for what its Content-Type says."""
    return pytest.param(data, content_type, 415, "unsupported_media_type", None, id=case)


CREATE_CASES = [
    # Not JSON at all
    invalid("not-json", b"{not json"),
    invalid("empty-body", b""),
    invalid("truncated", b'{"name": "Rex", "categoryId": 1'),
    invalid("trailing-garbage", body() + b" x"),
    invalid("not-utf8", b'{"name": "\xff", "categoryId": 1}'),
    invalid("deeply-nested-arrays", b"[" * 8000 + b"]" * 8000),
    invalid("deeply-nested-objects", b'{"a":' * 2500 + b"1" + b"}" * 2500),
    # JSON, but not an object
    invalid("array", b"[]"),
    invalid("array-of-pet", b'[{"name": "Rex", "categoryId": 1}]'),
    invalid("string", b'"Rex"'),
    invalid("number", b"42"),
    invalid("null", b"null"),
    invalid("boolean", b"true"),
    # Not sent as JSON
    unsupported("text-plain", body(), "text/plain"),
    unsupported("no-content-type", body(), None),
    unsupported("form", b"name=Rex&categoryId=1", "application/x-www-form-urlencoded"),
    unsupported("multipart", b"--b\r\n\r\n--b--\r\n", "multipart/form-data; boundary=b"),
    unsupported("xml", body(), "application/xml"),
    # Unknown fields
    invalid("id", body(id=5), "id"),
    invalid("unknown-field", body(color="red"), "color"),
    invalid("snake-case", body(categoryId=..., category_id=1), "category_id"),
    # name
    invalid("name-missing", body(name=...), "name"),
    invalid("name-empty", body(name=""), "name"),
    invalid("name-with-nul", body(name="Re\x00x"), "name"),
    invalid("name-lone-surrogate", body(name="\ud800"), "name"),
    invalid("name-null", body(name=None), "name"),
    invalid("name-number", body(name=5), "name"),
    invalid("name-array", body(name=["Rex"]), "name"),
    # categoryId
    invalid("category-missing", body(categoryId=...), "categoryId"),
    invalid("category-string", body(categoryId="1"), "categoryId"),
    invalid("category-float", body(categoryId=1.5), "categoryId"),
    invalid("category-1.0", b'{"name": "Rex", "categoryId": 1.0}', "categoryId"),
    invalid("category-exponent", b'{"name": "Rex", "categoryId": 1e2}', "categoryId"),
    invalid("category-nan", b'{"name": "Rex", "categoryId": NaN}'),
    invalid("category-true", body(categoryId=True), "categoryId"),
    invalid("category-false", body(categoryId=False), "categoryId"),
    invalid("category-null", body(categoryId=None), "categoryId"),
    invalid("category-array", body(categoryId=[1]), "categoryId"),
    invalid("category-2**63", body(categoryId=INT64_MAX + 1), "categoryId"),
    invalid("category--2**63-1", body(categoryId=INT64_MIN - 1), "categoryId"),
    invalid("category-10**30", body(categoryId=10**30), "categoryId"),
    invalid("category-5000-digits", b'{"name": "Rex", "categoryId": ' + b"9" * 5000 + b"}"),
    # status
    invalid("status-unknown", body(status="lost"), "status"),
    invalid("status-null", body(status=None), "status"),
    invalid("status-capitalised", body(status="Available"), "status"),
    invalid("status-upper-case", body(status="SOLD"), "status"),
    invalid("status-empty", body(status=""), "status"),
    invalid("status-padded", body(status=" sold"), "status"),
    invalid("status-number", body(status=1), "status"),
]


@pytest.mark.parametrize(("data", "content_type", "status", "code", "field"), CREATE_CASES)
def test_bad_create_is_refused_and_changes_nothing(
    client: FlaskClient,
    auth_headers: dict[str, str],
    conn: db.Connection,
    seeded: list[dict[str, Any]],
    data: bytes,
    content_type: str | None,
    status: int,
    code: str,
    field: str | None,
) -> None:
    headers = dict(auth_headers)
    if content_type is not None:
        headers["Content-Type"] = content_type

    response = client.post("/v1/pets", data=data, headers=headers)

    error = assert_error(response, status, code)
    if field is not None:
        assert field in error["errors"], error
    assert "Location" not in response.headers
    assert count_pets(conn) == len(seeded)
    assert table(conn) == seeded


@pytest.mark.parametrize(
    "over", [pytest.param(1, id="one-byte-over"), pytest.param(1 << 20, id="a-mebibyte-over")]
)
def test_body_over_the_cap_is_413(
    app: Flask,
    client: FlaskClient,
    auth_headers: dict[str, str],
    conn: db.Connection,
    seeded: list[dict[str, Any]],
    over: int,
) -> None:
    cap = app.config["MAX_CONTENT_LENGTH"]
    assert cap == 16384
    shell = body(name="")
    data = shell.replace(b'""', b'"' + b"x" * (cap + over - len(shell)) + b'"')
    assert len(data) == cap + over

    response = client.post(
        "/v1/pets", data=data, content_type="application/json", headers=auth_headers
    )

    assert_error(response, 413, "payload_too_large")
    assert table(conn) == seeded


def test_chunked_body_over_the_cap_is_413(
    app: Flask,
    client: FlaskClient,
    auth_headers: dict[str, str],
    conn: db.Connection,
    seeded: list[dict[str, Any]],
) -> None:
    # No Content-Length: the cap must hold while reading, as gunicorn passes chunked bodies on.
    # Valid JSON up to the cap and blanks after it: a body cut at the cap would be accepted.
    data = body() + b" " * app.config["MAX_CONTENT_LENGTH"]

    response = post_chunked(client, data, auth_headers)

    assert_error(response, 413, "payload_too_large")
    assert table(conn) == seeded


def test_cap_follows_the_setting(
    make_app: Callable[..., Flask],
    auth_headers: dict[str, str],
    conn: db.Connection,
    seeded: list[dict[str, Any]],
) -> None:
    client = make_app(MAX_CONTENT_LENGTH=1024).test_client()

    response = client.post(
        "/v1/pets",
        data=body(name="x" * 1024),
        content_type="application/json",
        headers=auth_headers,
    )

    assert_error(response, 413, "payload_too_large")
    assert table(conn) == seeded


@pytest.mark.parametrize(
    "category_id",
    [
        pytest.param(INT64_MAX, id="2**63-1"),
        pytest.param(INT64_MIN, id="-2**63"),
        pytest.param(0, id="zero"),
        pytest.param(-1, id="negative"),
    ],
)
def test_int64_bounds_of_category_id_are_accepted(
    client: FlaskClient, auth_headers: dict[str, str], conn: db.Connection, category_id: int
) -> None:
    response = client.post(
        "/v1/pets", json={"name": "Rex", "categoryId": category_id}, headers=auth_headers
    )

    assert response.status_code == 201
    assert response.get_json()["categoryId"] == category_id
    row = conn.execute(
        "select category_id from pets where id = %s", [response.get_json()["id"]]
    ).fetchone()
    assert row == {"category_id": category_id}


# (query string, field named in errors)
LIST_CASES = [
    pytest.param("limit=0", "limit", id="limit-0"),
    pytest.param("limit=101", "limit", id="limit-101"),
    pytest.param("limit=-1", "limit", id="limit-negative"),
    pytest.param("limit=1.5", "limit", id="limit-float"),
    pytest.param("limit=abc", "limit", id="limit-abc"),
    pytest.param("limit=", "limit", id="limit-empty"),
    pytest.param("limit=%2B5", "limit", id="limit-plus-sign"),
    pytest.param("limit=%205", "limit", id="limit-leading-space"),
    pytest.param("limit=5%20", "limit", id="limit-trailing-space"),
    pytest.param("limit=%D9%A3", "limit", id="limit-arabic-indic-digit"),
    pytest.param("limit=%EF%BC%95", "limit", id="limit-fullwidth-digit"),
    pytest.param("limit=%C2%B2", "limit", id="limit-superscript-two"),
    pytest.param("limit=1e1", "limit", id="limit-exponent"),
    pytest.param("limit=0x10", "limit", id="limit-hex"),
    pytest.param("limit=5_0", "limit", id="limit-underscore"),
    pytest.param("limit=%00", "limit", id="limit-nul"),
    pytest.param("limit=99999999999999999999999", "limit", id="limit-huge"),
    pytest.param("status=lost", "status", id="status-unknown"),
    pytest.param("status=", "status", id="status-empty"),
    pytest.param("status=Sold", "status", id="status-capitalised"),
    pytest.param("status=%00", "status", id="status-nul"),
    pytest.param("colour=red", "colour", id="unknown-parameter"),
    pytest.param("offset=20", "offset", id="offset"),
    pytest.param("limit=5&page=2", "page", id="page"),
    pytest.param("after=abc", "after", id="after-abc"),
    pytest.param("after=-1", "after", id="after-negative"),
    pytest.param("after=1.5", "after", id="after-float"),
    pytest.param("after=", "after", id="after-empty"),
    pytest.param("after=%2B1", "after", id="after-plus-sign"),
    pytest.param("after=9223372036854775808", "after", id="after-2**63"),
    pytest.param("after=99999999999999999999", "after", id="after-20-digits"),
]


@pytest.mark.parametrize(("query", "field"), LIST_CASES)
def test_bad_list_query_is_400(
    client: FlaskClient,
    auth_headers: dict[str, str],
    conn: db.Connection,
    seeded: list[dict[str, Any]],
    query: str,
    field: str,
) -> None:
    response = client.get(f"/v1/pets?{query}", headers=auth_headers)

    error = assert_error(response, 400, "invalid_request")
    assert field in error["errors"], error
    assert "Link" not in response.headers
    assert count_pets(conn) == len(seeded)


@pytest.mark.parametrize(
    "pet_id",
    [
        pytest.param("abc", id="letters"),
        pytest.param("1.5", id="float"),
        pytest.param("-1", id="negative"),
        pytest.param("0", id="zero"),
        pytest.param("%2B1", id="plus-sign"),
        pytest.param("%201", id="leading-space"),
        pytest.param("1e3", id="exponent"),
        pytest.param("%D9%A3", id="arabic-indic-digit"),
        pytest.param("%00", id="nul"),
        pytest.param("9223372036854775808", id="2**63"),
        pytest.param("99999999999999999999999999", id="huge"),
        pytest.param("9223372036854775807", id="2**63-1-no-such-pet"),
    ],
)
def test_bad_pet_id_is_404(
    client: FlaskClient,
    auth_headers: dict[str, str],
    conn: db.Connection,
    seeded: list[dict[str, Any]],
    pet_id: str,
) -> None:
    response = client.get(f"/v1/pets/{pet_id}", headers=auth_headers)

    assert_error(response, 404, "not_found")
    assert response.headers["Sunset"] == "Thu, 05 Dec 2030 00:00:00 GMT"
    assert count_pets(conn) == len(seeded)
