"""Reads on standbys (PETSTORE_READ_DATABASE_URL): lists and gets there, everything else on the primary.

A scratch database with rows of its own stands for the standby, so that each answer shows where
it was read.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from flask import Flask
from psycopg import conninfo

from petstore import config, db, migrations, standbys
from tests.conftest import count_pets
from tests.support.checks import assert_error
from tests.support.databases import empty_database
from tests.support.servers import free_port

NEW_PET = {"name": "Rex", "categoryId": 1, "status": "available"}
# The standby's own pet: an id the primary's test rows never reach.
STANDBY_PET_ID = 1000


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def standby_url(database_url: str) -> Iterator[str]:
    """A migrated scratch database holding one pet of its own, STANDBY_PET_ID; its URL."""
    with empty_database(database_url, "_standby") as url:
        with db.connect(config.from_environ({"DATABASE_URL": url})) as conn:
            migrations.upgrade(conn)
            conn.execute(
                """
                insert into pets (id, name, category_id, status)
                overriding system value
                values (%(id)s, 'on-the-standby', 1, 'available')
                """,
                {"id": STANDBY_PET_ID},
            )
        yield url


@pytest.fixture
def key(issue_key: Callable[..., str]) -> str:
    """A key on the primary only: the standby stand-in has no keys at all."""
    return issue_key("enterprise", per_minute=1000, per_day=100_000)


def test_lists_and_gets_read_from_the_standby(
    make_app: Callable[..., Flask], key: str, standby_url: str
) -> None:
    client = make_app(READ_DATABASE_URL=standby_url).test_client()
    listed = client.get("/v1/pets", headers=bearer(key))
    assert listed.status_code == 200, listed.json
    assert [pet["name"] for pet in listed.json] == ["on-the-standby"]
    by_status = client.get("/v1/pets?status=available", headers=bearer(key))
    assert [pet["id"] for pet in by_status.json] == [STANDBY_PET_ID]
    got = client.get(f"/v1/pets/{STANDBY_PET_ID}", headers=bearer(key))
    assert got.status_code == 200 and got.json["name"] == "on-the-standby"


def test_writes_and_keys_stay_on_the_primary(
    make_app: Callable[..., Flask], key: str, standby_url: str, conn: db.Connection
) -> None:
    """The key is found (on the primary), the pet is stored there, idempotency records too."""
    client = make_app(READ_DATABASE_URL=standby_url).test_client()
    headers = {**bearer(key), "Idempotency-Key": "reads-on-standbys-1"}
    created = client.post("/v1/pets", headers=headers, json=NEW_PET)
    again = client.post("/v1/pets", headers=headers, json=NEW_PET)
    assert (created.status_code, again.status_code) == (201, 201)
    assert again.json == created.json
    assert count_pets(conn) == 1
    with db.connect(config.from_environ({"DATABASE_URL": standby_url})) as standby:
        assert count_pets(standby) == 1  # its own pet only


def test_a_get_not_yet_on_the_standby_asks_the_primary(
    make_app: Callable[..., Flask], key: str, standby_url: str
) -> None:
    """Read-your-writes for getPet: a pet the standby does not have yet is found on the primary;
    a pet neither has is 404."""
    client = make_app(READ_DATABASE_URL=standby_url).test_client()
    created = client.post("/v1/pets", headers=bearer(key), json=NEW_PET)
    assert created.status_code == 201
    got = client.get(created.headers["Location"], headers=bearer(key))
    assert got.status_code == 200 and got.json == created.json
    # The list may lag (the standby's): not the new pet.
    listed = client.get("/v1/pets", headers=bearer(key))
    assert created.json["id"] not in [pet["id"] for pet in listed.json]
    missing = client.get(f"/v1/pets/{STANDBY_PET_ID + 1}", headers=bearer(key))
    assert_error(missing, 404, "not_found")


def test_standbys_down_reads_fall_back_to_the_primary(
    make_app: Callable[..., Flask], key: str, database_url: str
) -> None:
    """Nothing listens at the read URL: lists and gets are answered from the primary, no 5xx, and
    only the first read waits (a bounded moment) for the standby."""
    dead = conninfo.make_conninfo(database_url, host="127.0.0.1", port=str(free_port()))
    app = make_app(READ_DATABASE_URL=dead, DB_RECONNECT_TIMEOUT=0.5)
    client = app.test_client()
    created = client.post("/v1/pets", headers=bearer(key), json=NEW_PET)
    assert created.status_code == 201
    started = time.monotonic()
    listed = client.get("/v1/pets", headers=bearer(key))
    assert listed.status_code == 200, listed.json
    assert [pet["id"] for pet in listed.json] == [created.json["id"]]
    assert time.monotonic() - started < standbys.READ_POOL_TIMEOUT + 1.0
    started = time.monotonic()
    for _ in range(5):
        got = client.get(created.headers["Location"], headers=bearer(key))
        assert got.status_code == 200, got.json
    # Resting from the standbys: no wait for them on each read.
    assert time.monotonic() - started < standbys.READ_POOL_TIMEOUT


def test_a_prefer_standby_url_reads_no_server_that_is_not_a_standby(
    make_app: Callable[..., Flask], key: str, standby_url: str
) -> None:
    """prefer-standby falls back to the first host that takes a connection when no standby does:
    after a failover, perhaps a primary deposed behind its back. A server that says it is not in
    hot standby is not read from: the primary by DATABASE_URL answers (the stand-in is no
    standby, so its pet is not listed)."""
    url = conninfo.make_conninfo(standby_url, target_session_attrs="prefer-standby")
    client = make_app(READ_DATABASE_URL=url).test_client()
    created = client.post("/v1/pets", json=NEW_PET, headers=bearer(key))
    assert created.status_code == 201, created.json

    listed = client.get("/v1/pets", headers=bearer(key))

    assert listed.status_code == 200, listed.json
    assert [pet["name"] for pet in listed.json] == [NEW_PET["name"]]
