"""Bearer authentication over HTTP: who gets a 401, the challenge it carries, and how keys are made and stored."""

from __future__ import annotations

import hashlib
import string
from collections.abc import Callable

import pytest
from flask.testing import FlaskClient

from petstore import db, keys
from petstore.queries import keys as key_sql
from tests.conftest import count_pets
from tests.support.checks import assert_error, pass_key_cache_bound

REALM = 'Bearer realm="petstore"'
INVALID_TOKEN = 'Bearer realm="petstore", error="invalid_token"'
BASE64URL = set(string.ascii_letters + string.digits + "-_")
UNKNOWN_KEY = "ps_" + "A" * 43


def assert_unauthorized(response: object, challenge: str) -> None:
    body = assert_error(response, 401, "unauthorized")  # type: ignore[arg-type]
    assert set(body) == {"code", "message", "status"}
    assert response.headers.get_all("WWW-Authenticate") == [challenge]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("authorization", "challenge"),
    [
        pytest.param(None, REALM, id="missing"),
        pytest.param("", REALM, id="empty-header"),
        pytest.param("Basic dXNlcjpwYXNzd29yZA==", REALM, id="basic-scheme"),
        pytest.param("Digest username=x", REALM, id="digest-scheme"),
        pytest.param("Bearer", REALM, id="bearer-without-token"),
        pytest.param("Bearer ", REALM, id="bearer-empty-token"),
        pytest.param("Bearer garbage", INVALID_TOKEN, id="bearer-garbage"),
        pytest.param("Bearer ps_", INVALID_TOKEN, id="bearer-prefix-only"),
        pytest.param(f"Bearer {UNKNOWN_KEY}", INVALID_TOKEN, id="bearer-unknown-key"),
        pytest.param(f"bearer {UNKNOWN_KEY}", INVALID_TOKEN, id="lowercase-bearer-unknown-key"),
        pytest.param("Bearer '||'1'='1", INVALID_TOKEN, id="bearer-sql-ish"),
        pytest.param("Bearer " + "x" * 4000, INVALID_TOKEN, id="bearer-long-token"),
        pytest.param("Bearer ps_" + "A" * 42 + "!", INVALID_TOKEN, id="bearer-not-a-token68"),
    ],
)
def test_request_without_a_valid_key_is_401(
    client: FlaskClient, api_key: str, authorization: str | None, challenge: str
) -> None:
    headers = {} if authorization is None else {"Authorization": authorization}

    response = client.get("/v1/pets", headers=headers)

    assert_unauthorized(response, challenge)


def test_a_valid_key_with_something_appended_is_401(client: FlaskClient, api_key: str) -> None:
    response = client.get("/v1/pets", headers={"Authorization": f"Bearer {api_key}x"})

    assert_unauthorized(response, INVALID_TOKEN)


def test_a_valid_key_under_another_scheme_is_401(client: FlaskClient, api_key: str) -> None:
    response = client.get("/v1/pets", headers={"Authorization": f"Token {api_key}"})

    assert_unauthorized(response, REALM)


@pytest.mark.parametrize(
    "separator",
    [
        pytest.param("\xa0", id="no-break-space"),
        pytest.param("\x85", id="next-line"),
        pytest.param("\t", id="tab"),
        pytest.param("", id="none"),
    ],
)
def test_a_valid_key_after_anything_but_spaces_is_401(
    client: FlaskClient, api_key: str, separator: str
) -> None:
    # RFC 6750: the scheme, one or more spaces, the token. Python's str.split() would also take
    # Unicode whitespace as a separator.
    response = client.get("/v1/pets", headers={"Authorization": f"Bearer{separator}{api_key}"})

    assert_unauthorized(response, REALM)


def test_several_spaces_after_the_scheme_are_one_separator(
    client: FlaskClient, api_key: str
) -> None:
    response = client.get("/v1/pets", headers={"Authorization": f"Bearer   {api_key}"})

    assert response.status_code == 200


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_scheme_is_case_insensitive(client: FlaskClient, api_key: str, scheme: str) -> None:
    response = client.get("/v1/pets", headers={"Authorization": f"{scheme} {api_key}"})

    assert response.status_code == 200
    assert response.get_json() == []
    assert "WWW-Authenticate" not in response.headers


def test_revoked_key_is_401(client: FlaskClient, conn: db.Connection) -> None:
    key, row = keys.issue_key(conn, "free", "to revoke")
    headers = {"Authorization": f"Bearer {key}"}
    assert client.get("/v1/pets", headers=headers).status_code == 200

    assert key_sql.revoke_key(conn, row["id"]) is True
    pass_key_cache_bound(client.application)
    response = client.get("/v1/pets", headers=headers)

    assert_unauthorized(response, INVALID_TOKEN)


def test_revoking_one_key_leaves_the_others(
    client: FlaskClient, conn: db.Connection, api_key: str
) -> None:
    _key, row = keys.issue_key(conn, "free", "to revoke")

    key_sql.revoke_key(conn, row["id"])

    assert client.get("/v1/pets", headers={"Authorization": f"Bearer {api_key}"}).status_code == 200


@pytest.mark.parametrize(
    ("method", "path"),
    [
        pytest.param("GET", "/v1/pets", id="listPets"),
        pytest.param("POST", "/v1/pets", id="createPet"),
        pytest.param("GET", "/v1/pets/1", id="getPet"),
        pytest.param("GET", "/v1/store/orders", id="orders"),
        pytest.param("GET", "/v1/nope", id="unknown-v1-path"),
        pytest.param("GET", "/v1", id="v1-itself"),
        pytest.param("GET", "/v1/", id="v1-slash"),
        pytest.param("DELETE", "/v1/pets", id="wrong-method"),
    ],
)
def test_every_v1_path_needs_a_key(
    client: FlaskClient, conn: db.Connection, api_key: str, method: str, path: str
) -> None:
    before = count_pets(conn)

    response = client.open(path, method=method, json={"name": "Rex", "categoryId": 1})

    assert_unauthorized(response, REALM)
    assert count_pets(conn) == before


def test_createpet_with_a_bad_key_stores_nothing(client: FlaskClient, conn: db.Connection) -> None:
    response = client.post(
        "/v1/pets",
        json={"name": "Rex", "categoryId": 1},
        headers={"Authorization": f"Bearer {UNKNOWN_KEY}"},
    )

    assert_unauthorized(response, INVALID_TOKEN)
    assert count_pets(conn) == 0


def test_healthz_ignores_a_bad_key(client: FlaskClient) -> None:
    response = client.get("/healthz", headers={"Authorization": "Bearer garbage"})

    assert response.status_code == 200


def test_key_is_stored_only_as_a_sha256_hash_with_a_short_prefix(conn: db.Connection) -> None:
    key, row = keys.issue_key(conn, "pro", "stored")

    stored = conn.execute("select * from api_keys where id = %s", [row["id"]]).fetchone()
    assert stored is not None
    assert bytes(stored["key_hash"]) == hashlib.sha256(key.encode()).digest()
    assert key.startswith(stored["prefix"])
    assert 4 <= len(stored["prefix"]) <= 12
    # The secret appears in no column, whole or in any longer piece than the prefix.
    as_text = conn.execute(
        "select api_keys::text as t from api_keys where id = %s", [row["id"]]
    ).fetchone()
    assert as_text is not None
    assert key not in as_text["t"]
    assert key[: len(stored["prefix"]) + 1] not in as_text["t"]
    assert key.encode().hex() not in as_text["t"]


def test_keys_are_random_and_at_least_256_bits(
    issue_key: Callable[..., str], conn: db.Connection
) -> None:
    issued = [issue_key("free") for _ in range(64)]

    assert len(set(issued)) == len(issued)
    for key in issued:
        assert key.startswith(keys.KEY_PREFIX)
        secret = key[len(keys.KEY_PREFIX) :]
        assert set(secret) <= BASE64URL
        # Each base64url character carries 6 bits.
        assert len(secret) * 6 >= 256
    # Random keys use the whole alphabet; a counter or a hex string would not.
    assert set("".join(key[len(keys.KEY_PREFIX) :] for key in issued)) == BASE64URL
    prefixes = conn.execute("select count(distinct prefix) as n from api_keys").fetchone()
    assert prefixes == {"n": len(issued)}
