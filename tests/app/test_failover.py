"""Following the primary: a multi-host DATABASE_URL, a write that meets a read-only server, no primary."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from flask import Flask
from psycopg import conninfo, sql

from petstore import config, create_app, db, keys, migrations
from tests.conftest import count_pets
from tests.support.checks import assert_error
from tests.support.databases import empty_database
from tests.support.servers import free_port

RATE_HEADERS = ("X-RateLimit-Limit", "X-RateLimit-Remaining")
NEW_PET = {"name": "Rex", "categoryId": 1, "status": "available"}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def read_write(url: str, *hosts: tuple[str, int]) -> str:
    """`url` naming `hosts` in turn, asking libpq for the one that accepts writes."""
    return conninfo.make_conninfo(
        url,
        host=",".join(host for host, _port in hosts),
        port=",".join(str(port) for _host, port in hosts),
        target_session_attrs="read-write",
    )


def server_of(url: str) -> tuple[str, int]:
    params = conninfo.conninfo_to_dict(url)
    return str(params.get("host", "127.0.0.1")), int(params.get("port", 5432))


def test_a_multi_host_url_reaches_the_host_that_answers(
    make_app: Callable[..., Flask], issue_key: Callable[..., str], database_url: str
) -> None:
    """A first host that refuses connections (a dead primary) is passed over for the next one."""
    url = read_write(database_url, ("127.0.0.1", free_port()), server_of(database_url))
    client = make_app(DATABASE_URL=url).test_client()
    key = issue_key("enterprise", per_minute=1000, per_day=100_000)
    created = client.post("/v1/pets", headers=bearer(key), json=NEW_PET)
    assert created.status_code == 201, created.json
    assert client.get(created.headers["Location"], headers=bearer(key)).status_code == 200


def test_a_write_on_a_read_only_server_is_503_and_the_next_one_reaches_a_writable_one(
    make_app: Callable[..., Flask], issue_key: Callable[..., str], conn: db.Connection
) -> None:
    """Every pooled connection turned read-only (as a standby's are): the write answers 503 and
    the pool replaces all of them, so the next write is not attempted on a read-only one."""
    app = make_app(DB_POOL_SIZE=3)
    client = app.test_client()
    key = issue_key("enterprise", per_minute=1000, per_day=100_000)
    pool = app.extensions["petstore.pool"]
    pool.wait()
    taken = [pool.getconn() for _ in range(3)]
    for read_only in taken:
        read_only.execute("set default_transaction_read_only = on")
        pool.putconn(read_only)
    refused = client.post("/v1/pets", headers=bearer(key), json=NEW_PET)
    assert_error(refused, 503, "service_unavailable")
    assert int(refused.headers["Retry-After"]) >= 1
    assert count_pets(conn) == 0
    for _ in range(4):
        created = client.post("/v1/pets", headers=bearer(key), json=NEW_PET)
        assert created.status_code == 201, created.json
    assert count_pets(conn) == 4


@pytest.fixture
def read_only_database(database_url: str) -> Iterator[str]:
    """A migrated scratch database whose new sessions are all read-only (a cluster with no
    primary, as libpq sees it); its URL. Writable again after `make_writable(url)`."""
    with empty_database(database_url, "_failover") as url:
        with db.connect(config.from_environ({"DATABASE_URL": url})) as admin:
            migrations.upgrade(admin)
        yield url


def set_read_only(url: str, read_only: bool) -> None:
    dbname = conninfo.conninfo_to_dict(url)["dbname"]
    statement = "alter database {} set default_transaction_read_only = on"
    if not read_only:
        statement = "alter database {} reset default_transaction_read_only"
    with db.connect(config.from_environ({"DATABASE_URL": url})) as admin:
        admin.execute("set default_transaction_read_only = off")
        admin.execute(sql.SQL(statement).format(sql.Identifier(dbname)))


def test_no_primary_is_a_fast_503_that_spends_no_budget(read_only_database: str) -> None:
    """target_session_attrs=read-write finds no writable server: 503 with Retry-After within the
    pool's wait, the address's budget untouched; writes again once a primary is back."""
    with db.connect(config.from_environ({"DATABASE_URL": read_only_database})) as admin:
        key, _row = keys.issue_key(admin, "enterprise", "failover", 5, 1000)
    set_read_only(read_only_database, True)
    url = read_write(read_only_database, server_of(read_only_database))
    app = create_app(
        {
            "DATABASE_URL": url,
            "TESTING": True,
            "DB_POOL_SIZE": 2,
            "DB_POOL_TIMEOUT": 0.5,
            "DB_RECONNECT_TIMEOUT": 0.5,
            "IP_LIMITS": "3/minute",
        }
    )
    client = app.test_client()
    try:
        for _ in range(5):
            started = time.monotonic()
            refused = client.post("/v1/pets", headers=bearer(key), json=NEW_PET)
            assert time.monotonic() - started < 2.5
            assert_error(refused, 503, "service_unavailable")
            assert int(refused.headers["Retry-After"]) >= 1
            # The address's budget as it stands, untouched; the key's was never reached.
            assert tuple(int(refused.headers[name]) for name in RATE_HEADERS) == (3, 3)
        set_read_only(read_only_database, False)
        deadline = time.monotonic() + 10
        while True:
            created = client.post("/v1/pets", headers=bearer(key), json=NEW_PET)
            if created.status_code == 201 or time.monotonic() > deadline:
                break
            assert_error(created, 503, "service_unavailable")
            time.sleep(0.2)
        assert created.status_code == 201, created.json
        # The key's first spent request is this one.
        assert tuple(int(created.headers[name]) for name in RATE_HEADERS) == (5, 4)
    finally:
        app.extensions["petstore.pool"].close()
