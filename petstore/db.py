"""The connection pool and the request's connection (the migrations runner: petstore.migrations)."""

from __future__ import annotations

import logging
import select
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import psycopg
from flask import Flask, current_app, g
from psycopg import sql
from psycopg.rows import DictRow, dict_row
from psycopg_pool import ConnectionPool

from petstore import hostorder

log = logging.getLogger(__name__)

Connection = psycopg.Connection[DictRow]


def behind_transaction_pooler(config: Mapping[str, Any]) -> bool:
    """Whether DATABASE_URL is a pooler in transaction mode (PETSTORE_DB_POOLER=transaction)."""
    return bool(config.get("DB_POOLER", "none") == "transaction")


def connection_kwargs(config: Mapping[str, Any]) -> dict[str, Any]:
    """libpq and psycopg options every connection of the service uses."""
    kwargs: dict[str, Any] = {
        "autocommit": True,
        "row_factory": dict_row,
        "connect_timeout": config["DB_CONNECT_TIMEOUT"],
        "application_name": "petstore",
        **tcp_liveness(config),
    }
    if behind_transaction_pooler(config):
        # Each transaction may run on another server connection: a statement prepared on one
        # is missing on the next, or another statement's of the same name runs with our
        # parameters. No server-side prepared statements, then. PgBouncer refuses the
        # `options` startup parameter; the timeout is the database's instead (pin_statement_timeout).
        kwargs["prepare_threshold"] = None
    else:
        kwargs["options"] = f"-c statement_timeout={config['DB_STATEMENT_TIMEOUT_MS']}"
    return kwargs


def tcp_liveness(config: Mapping[str, Any]) -> dict[str, int]:
    """libpq's TCP options that find a server gone silent (packets dropped, no RST).

    Without them a statement sent to a vanished server waits some fifteen minutes for the
    kernel's retransmissions. tcp_user_timeout cuts a connection whose sent data stays
    unacknowledged for DB_CONNECT_TIMEOUT (a live server acknowledges in milliseconds, however
    long the statement runs); keepalives find a server that vanished while we waited for its
    answer. A request on a silent server then answers 503 within its statement timeout plus a
    few seconds (tests/system/test_network_cut.py).
    """
    seconds = int(config["DB_CONNECT_TIMEOUT"])
    return {
        "keepalives": 1,
        "keepalives_idle": seconds,
        "keepalives_interval": 1,
        "keepalives_count": 3,
        "tcp_user_timeout": seconds * 1000,
    }


@dataclass
class TimeoutPin:
    """What the pool's new connections found of the server's statement_timeout.

    A database never pinned (`petstore db upgrade` skipped) is no reason to refuse traffic: its
    statements run unbounded, which gives no wrong answer, while /healthz, the metric
    petstore_db_statement_timeout_unpinned and one log line per new connection say so.
    """

    expected_ms: int
    # The last new connection's value when it was not the expected one; None while pinned.
    found_ms: int | None = None

    def warning(self) -> str | None:
        """What /healthz says while the last new connection found another timeout; else None."""
        if self.found_ms is None:
            return None
        return (
            f"statement_timeout is {self.found_ms} ms on the server, expected {self.expected_ms} "
            "ms (PETSTORE_DB_STATEMENT_TIMEOUT_MS): statements run unbounded until `petstore db "
            "upgrade` pins it on the database"
        )


def check_new_connection(
    config: Mapping[str, Any], pin: TimeoutPin | None = None
) -> Callable[[Connection], None]:
    """The pool's check of each new connection: find a pooler, and note an unpinned timeout in `pin`.

    A pooler is found whether it was declared or not (PETSTORE_DB_POOLER): PostgreSQL tells
    libpq its backend's pid on connecting, and a pooler (PgBouncer, in any pool mode) tells
    the client a pid of its own. Through one, the connection prepares no statement: another
    client may have prepared one of the same name on the same server connection. Through a
    pooler the timeout is the database's default (`petstore db upgrade` pins it).
    """
    expected = int(config["DB_STATEMENT_TIMEOUT_MS"])
    declared = behind_transaction_pooler(config)
    seen = TimeoutPin(expected) if pin is None else pin

    def check(conn: Connection) -> None:
        row = conn.execute(
            """
            select pg_backend_pid() as pid,
                   setting::int as statement_timeout
              from pg_settings
             where name = 'statement_timeout'
            """
        ).fetchone()
        assert row is not None
        if row["pid"] != conn.info.backend_pid:
            conn.prepare_threshold = None
            if not declared:
                log.warning(
                    "DATABASE_URL leads through a pooler: no prepared statements on its "
                    "connections (set PETSTORE_DB_POOLER=transaction to say so)"
                )
        if row["statement_timeout"] == expected:
            seen.found_ms = None
            return
        seen.found_ms = row["statement_timeout"]
        log.warning(
            "statement_timeout behind the pooler is %s ms, expected %s ms "
            "(PETSTORE_DB_STATEMENT_TIMEOUT_MS): this connection's statements run unbounded; run "
            "`petstore db upgrade` with PETSTORE_MIGRATION_DATABASE_URL, then RECONNECT in the "
            "PgBouncer console",
            row["statement_timeout"],
            expected,
        )

    return check


def pin_statement_timeout(conn: Connection, milliseconds: int) -> None:
    """Make `milliseconds` the statement_timeout of every new session of this database.

    For a transaction pooler, whose server connections carry no per-client settings.
    Sessions that set their own (the migrations, the direct `options`) keep theirs.
    """
    dbname = conn.execute("select current_database() as name").fetchone()
    assert dbname is not None
    conn.execute(
        sql.SQL("alter database {} set statement_timeout = {}").format(
            sql.Identifier(dbname["name"]), sql.Literal(milliseconds)
        )
    )


def open_pool(
    config: Mapping[str, Any],
    name: str = "petstore",
    url: str | None = None,
    pin: TimeoutPin | None = None,
    **options: Any,
) -> ConnectionPool[Connection]:
    """The process's pool of `url` (default DATABASE_URL), sized and bounded by the settings,
    opened without waiting; what its new connections find of the statement timeout goes to `pin`.

    Not waiting lets the app start while PostgreSQL is down: requests get 503 until it is back.
    """
    pool: ConnectionPool[Connection] = ConnectionPool(
        url or config["DATABASE_URL"],
        kwargs=connection_kwargs(config),
        min_size=config["DB_POOL_SIZE"],
        max_size=config["DB_POOL_SIZE"],
        timeout=config["DB_POOL_TIMEOUT"],
        configure=check_new_connection(config, pin),
        # A silent host last, and the role of the server behind a pooler checked (hostorder).
        connection_class=hostorder.ordered_connection_class(),
        name=name,
        open=False,
        **{"reconnect_timeout": config["DB_RECONNECT_TIMEOUT"], **options},
    )
    pool.open(wait=False)
    return pool


def init_app(app: Flask) -> None:
    """Create the pool (one per process) and release the request's connection after it."""
    pin = app.extensions["petstore.timeout_pin"] = TimeoutPin(app.config["DB_STATEMENT_TIMEOUT_MS"])
    app.extensions["petstore.pool"] = open_pool(app.config, pin=pin)
    app.teardown_appcontext(_release_conn)


def get_pool() -> ConnectionPool[Connection]:
    """The pool of the current app."""
    pool: ConnectionPool[Connection] = current_app.extensions["petstore.pool"]
    return pool


def get_conn() -> Connection:
    """The request's connection (autocommit), taken from the pool on first use."""
    if "conn" not in g:
        g.conn = take_live(get_pool())
    conn: Connection = g.conn
    return conn


def take_live(pool: ConnectionPool[Connection], timeout: float | None = None) -> Connection:
    """A connection of `pool`; when the one it gave was cut, the pool tests its idle ones first.

    A restart of PostgreSQL cuts the pool's idle connections without the pool noticing: the
    server's farewell waits unread on the socket. Polling it costs a microsecond, where testing
    every connection before handing it out would cost a round trip.
    """
    conn = pool.getconn(timeout=timeout)
    if cut_while_idle(conn):
        pool.putconn(conn)
        pool.check()
        conn = pool.getconn(timeout=timeout)
    return conn


def cut_while_idle(conn: Connection) -> bool:
    """Whether an idle connection has something to read: the server closed it, or said it will."""
    if conn.closed:
        return True
    # poll, not select: a descriptor past FD_SETSIZE (1024) is fine.
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN)
    return bool(poller.poll(0))


def _release_conn(exc: BaseException | None) -> None:
    conn = g.pop("conn", None)
    if conn is not None:
        get_pool().putconn(conn)


def discard_broken_connections() -> None:
    """After a connection failed, make the pool test its idle ones so the next requests get live ones."""
    conn = g.pop("conn", None)
    pool = get_pool()
    if conn is not None:
        pool.putconn(conn)
    pool.check()


def close_request_connection() -> None:
    """Close the request's connection, in a state nobody can tell: the pool replaces it."""
    conn = g.get("conn")
    if conn is not None:
        conn.close()


def discard_read_only_connections() -> None:
    """After a write met a read-only server (a standby, a demoted primary), replace every connection.

    The others most likely went to the same server: idle ones are closed now, those in use when
    they come back, and new ones follow target_session_attrs=read-write to the primary.
    """
    conn = g.pop("conn", None)
    pool = get_pool()
    pool.drain()
    if conn is not None:
        pool.putconn(conn)


def connect(config: dict[str, Any]) -> Connection:
    """A connection outside any request, for the CLI and tests."""
    return psycopg.connect(config["DATABASE_URL"], **connection_kwargs(config))
