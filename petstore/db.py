"""The connection pool, the request's connection, and the migrations runner."""

from __future__ import annotations

import logging
import re
import select
import time
from collections.abc import Callable, Mapping
from importlib import resources
from typing import Any, TypeVar

import psycopg
from flask import Flask, current_app, g
from psycopg import sql
from psycopg.rows import DictRow, dict_row
from psycopg_pool import ConnectionPool, PoolTimeout

from petstore import hostorder

log = logging.getLogger(__name__)

Connection = psycopg.Connection[DictRow]
T = TypeVar("T")

# pg_advisory_lock key held while migrating, so that two `petstore db upgrade` wait for each other.
MIGRATION_LOCK = 0x7065_7473_746F_7265 >> 1  # "petstore", kept inside bigint

MIGRATION_NAME = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")

# The longest a read waits for a connection to a standby before it asks the primary instead.
READ_POOL_TIMEOUT = 0.2
# After a standby failed a read, this worker reads from the primary for this long (seconds).
READ_POOL_REST = 5.0
# A read connection is replaced after this long (seconds), so that one that fell back to the
# primary (prefer-standby, while the standbys were down) returns to a standby once one is back.
READ_CONNECTION_LIFETIME = 60.0


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

    Without them a statement sent to a vanished server waits for the kernel's retransmissions,
    some fifteen minutes, and the request with it. tcp_user_timeout closes a connection whose
    sent data stays unacknowledged for DB_CONNECT_TIMEOUT: a live server's kernel acknowledges
    in milliseconds, however long the statement runs, so no slow statement is cut. Keepalives
    find a server that vanished while we waited for its answer: after DB_CONNECT_TIMEOUT of
    silence, a probe each second, and the connection is closed when one stays unanswered past
    tcp_user_timeout (Linux) or three in a row do. So a request on a silent server answers 503
    within its statement timeout plus a few seconds (tests/system/test_network_cut.py).
    """
    seconds = int(config["DB_CONNECT_TIMEOUT"])
    return {
        "keepalives": 1,
        "keepalives_idle": seconds,
        "keepalives_interval": 1,
        "keepalives_count": 3,
        "tcp_user_timeout": seconds * 1000,
    }


class StatementTimeoutNotPinned(psycopg.OperationalError):
    """Behind a transaction pooler, the server's statement_timeout is not the configured one."""


def check_new_connection(config: Mapping[str, Any]) -> Callable[[Connection], None]:
    """The pool's check of each new connection: find a pooler, and refuse an unbounded timeout.

    A pooler is found whether it was declared or not (PETSTORE_DB_POOLER): PostgreSQL tells
    libpq its backend's pid on connecting, and a pooler (PgBouncer, in any pool mode) tells
    the client a pid of its own. Through one, the connection prepares no statement, so that a
    statement never runs against a plan that another client prepared on the same server
    connection (transaction pooling). A direct connection keeps its prepared statements.

    Through a pooler the timeout cannot travel with the connection: it is the database's
    default (`petstore db upgrade` pins it). A connection whose server has another value is
    refused, so that requests get 503 and the log says why, rather than running unbounded.
    """
    expected = int(config["DB_STATEMENT_TIMEOUT_MS"])
    declared = behind_transaction_pooler(config)

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
        if row["statement_timeout"] != expected:
            message = (
                f"statement_timeout behind the pooler is {row['statement_timeout']} ms, "
                f"expected {expected} ms (PETSTORE_DB_STATEMENT_TIMEOUT_MS): run `petstore db "
                "upgrade` with PETSTORE_DB_POOLER=transaction and PETSTORE_MIGRATION_DATABASE_URL, "
                "then RECONNECT in the PgBouncer console"
            )
            log.error("%s", message)
            raise StatementTimeoutNotPinned(message)

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
    **options: Any,
) -> ConnectionPool[Connection]:
    """The process's pool of `url` (default DATABASE_URL), sized and bounded by the settings,
    opened without waiting.

    Not waiting lets the app start while PostgreSQL is down: requests get 503 until it is back.
    """
    pool: ConnectionPool[Connection] = ConnectionPool(
        url or config["DATABASE_URL"],
        kwargs=connection_kwargs(config),
        min_size=config["DB_POOL_SIZE"],
        max_size=config["DB_POOL_SIZE"],
        timeout=config["DB_POOL_TIMEOUT"],
        reconnect_timeout=config["DB_RECONNECT_TIMEOUT"],
        configure=check_new_connection(config),
        # A silent host last, and the role of the server behind a pooler checked (hostorder).
        connection_class=hostorder.ordered_connection_class(),
        name=name,
        open=False,
        **options,
    )
    pool.open(wait=False)
    return pool


def init_app(app: Flask) -> None:
    """Create the pools (one per process, and one of the standbys when set) and release
    connections after each request."""
    app.extensions["petstore.pool"] = open_pool(app.config)
    if app.config.get("READ_DATABASE_URL"):
        app.extensions["petstore.read_pool"] = open_pool(
            app.config,
            "petstore-read",
            app.config["READ_DATABASE_URL"],
            max_lifetime=READ_CONNECTION_LIFETIME,
        )
        app.extensions["petstore.read_pool_rests_until"] = 0.0
    app.teardown_appcontext(_release_conn)


def get_pool() -> ConnectionPool[Connection]:
    """The pool of the current app."""
    pool: ConnectionPool[Connection] = current_app.extensions["petstore.pool"]
    return pool


def get_conn() -> Connection:
    """The request's connection, taken from the pool on first use.

    Connections are in autocommit mode: each statement is its own transaction,
    which saves the BEGIN and COMMIT round trips. Code that needs several
    statements to be atomic opens `with conn.transaction():` around them.

    A restart of PostgreSQL cuts the pool's idle connections without the pool noticing: the
    server's farewell waits unread on the socket. An idle connection with anything to read is
    suspect, then: the pool tests its idle connections and hands out a live one. Polling the
    socket costs a microsecond, where testing every connection before handing it out would
    cost a round trip; whatever the request's first statement is (the key's, or its view's
    when the key's row is cached), it meets no connection cut while it was idle.
    """
    if "conn" not in g:
        pool = get_pool()
        taken = pool.getconn()
        if cut_while_idle(taken):
            pool.putconn(taken)
            pool.check()
            taken = pool.getconn()
        g.conn = taken
    conn: Connection = g.conn
    return conn


def read(query: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`query(conn, ...)` on a standby (PETSTORE_READ_DATABASE_URL), else on the primary.

    Only for statements that write nothing and may lag by the replication delay. A standby that
    cannot be reached within READ_POOL_TIMEOUT, or fails the statement, is not an error: the
    primary answers, and this worker leaves the standbys alone for READ_POOL_REST seconds.
    """
    extensions = current_app.extensions
    pool: ConnectionPool[Connection] | None = extensions.get("petstore.read_pool")
    if pool is None or time.monotonic() < extensions["petstore.read_pool_rests_until"]:
        return query(get_conn(), *args, **kwargs)
    try:
        with pool.connection(timeout=READ_POOL_TIMEOUT) as conn:
            return query(conn, *args, **kwargs)
    except psycopg.errors.QueryCanceled:
        raise  # the statement timeout: the primary would take as long
    except (psycopg.OperationalError, psycopg.InterfaceError, PoolTimeout) as exc:
        log.warning(
            "standby unavailable, reading from the primary: %s: %s", type(exc).__name__, exc
        )
        extensions["petstore.read_pool_rests_until"] = time.monotonic() + READ_POOL_REST
    return query(get_conn(), *args, **kwargs)


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

    The pool's other connections went to the same server, most likely: each is closed, idle
    ones now and those in use when they come back, and new ones follow DATABASE_URL's
    target_session_attrs=read-write to the primary. So no write meets a standby twice in a row.
    """
    conn = g.pop("conn", None)
    pool = get_pool()
    pool.drain()
    if conn is not None:
        pool.putconn(conn)


def connect(config: dict[str, Any]) -> Connection:
    """A connection outside any request, for the CLI and tests."""
    return psycopg.connect(config["DATABASE_URL"], **connection_kwargs(config))


def migrations() -> list[tuple[str, str]]:
    """(name, SQL) of every numbered migration shipped in the package, in order."""
    files = resources.files("petstore.sql")
    found = sorted(f.name for f in files.iterdir() if MIGRATION_NAME.match(f.name))
    return [(name, files.joinpath(name).read_text(encoding="utf-8")) for name in found]


def upgrade(conn: Connection) -> list[str]:
    """Apply the migrations not yet applied, each in its own transaction; return their names.

    It holds a session-level advisory lock: `conn` must be a direct connection to PostgreSQL,
    never one through a transaction pooler (PETSTORE_MIGRATION_DATABASE_URL).
    """
    applied_now = []
    # Waiting for another upgrade, or building an index on a big table, may take longer than
    # the service's statement timeout: migrations have none.
    conn.execute("set statement_timeout = 0")
    conn.execute("select pg_advisory_lock(%s)", [MIGRATION_LOCK])
    try:
        with conn.transaction():
            conn.execute(
                """
                create table if not exists schema_migrations (
                    name       text primary key,
                    applied_at timestamptz not null default now()
                )
                """
            )
        rows = conn.execute("select name from schema_migrations").fetchall()
        done = {row["name"] for row in rows}
        for name, text in migrations():
            if name in done:
                continue
            with conn.transaction():
                conn.execute(text.encode())
                conn.execute("insert into schema_migrations (name) values (%s)", [name])
            log.info("applied migration %s", name)
            applied_now.append(name)
    finally:
        conn.execute("select pg_advisory_unlock(%s)", [MIGRATION_LOCK])
    return applied_now
