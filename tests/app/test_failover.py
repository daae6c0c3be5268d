"""Following the primary: a multi-host DATABASE_URL, a write that meets a read-only server, no primary."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import psycopg
import pytest
from flask import Flask
from psycopg import conninfo, sql

from petstore import config, create_app, db, hostorder, keys, migrations
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


@pytest.fixture
def silent_address() -> Iterator[tuple[str, int]]:
    """A loopback port that takes TCP connections and never says a word: to a client, a
    database host cut off the network (it waits its whole connect timeout)."""
    with socket.create_server(("127.0.0.1", 0), backlog=64) as server:
        host, port = server.getsockname()[:2]
        yield host, port


def test_a_silent_first_host_costs_its_connect_timeout_once(
    make_app: Callable[..., Flask],
    issue_key: Callable[..., str],
    database_url: str,
    silent_address: tuple[str, int],
) -> None:
    """DATABASE_URL's first host stays silent (the old primary cut off the network): the pool's
    first connection waits out the connect timeout there, and the next ones go first to the host
    that took it, without waiting."""
    url = read_write(database_url, silent_address, server_of(database_url))
    # From before the app: its pool starts connecting as it is made.
    started = time.monotonic()
    app = make_app(DATABASE_URL=url, DB_POOL_SIZE=1, DB_CONNECT_TIMEOUT=2)
    pool = app.extensions["petstore.pool"]
    pool.wait(timeout=10)
    first = time.monotonic() - started
    again = []
    for _ in range(3):
        started = time.monotonic()
        pool.drain()  # the connection closed, a new one made
        pool.wait(timeout=10)
        with pool.connection(timeout=10) as conn:
            conn.execute("select 1")
        again.append(time.monotonic() - started)
    assert first >= 1.9, first
    assert max(again) < 1.0, again
    key = issue_key("enterprise", per_minute=1000, per_day=100_000)
    created = app.test_client().post("/v1/pets", headers=bearer(key), json=NEW_PET)
    assert created.status_code == 201, created.json


def test_one_attempt_at_a_time_waits_on_a_silent_host(
    database_url: str, silent_address: tuple[str, int]
) -> None:
    """No primary to be had (the first host silent, the second read-only, as a standby is): one
    connection attempt waits out the silent host's timeout, and meanwhile the others pass it over
    and fail at once, so that the pool's next try finds a standby promoted in the meantime."""
    url = conninfo.make_conninfo(
        read_write(database_url, silent_address, server_of(database_url)),
        options="-c default_transaction_read_only=on",
        connect_timeout="2",
    )
    connection_class = hostorder.ordered_connection_class()
    started = time.monotonic()
    with pytest.raises(psycopg.OperationalError):
        connection_class.connect(url)
    assert time.monotonic() - started >= 1.9  # the first host is known silent now
    waited: list[float] = []

    def wait_on_it() -> None:
        began = time.monotonic()
        with pytest.raises(psycopg.OperationalError, match="not read-write"):
            connection_class.connect(url)
        waited.append(time.monotonic() - began)

    waiting = threading.Thread(target=wait_on_it)
    waiting.start()
    time.sleep(0.5)  # the standby refused it; it waits on the silent host
    started = time.monotonic()
    with pytest.raises(psycopg.OperationalError, match="another attempt waits on it"):
        connection_class.connect(url)
    passed_over = time.monotonic() - started
    waiting.join(timeout=10)
    assert passed_over < 1.0, passed_over
    assert waited and waited[0] >= 1.9, waited


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
