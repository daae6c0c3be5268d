"""The connection pool and the request's connection (the migrations runner: petstore.migrations)."""

from __future__ import annotations

import itertools
import logging
import math
import select
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg
from flask import Flask, current_app, g
from psycopg import sql
from psycopg.errors import Diagnostic
from psycopg.rows import DictRow, dict_row
from psycopg_pool import ConnectionPool, PoolTimeout

from petstore import hostorder

log = logging.getLogger(__name__)

Connection = psycopg.Connection[DictRow]
T = TypeVar("T")

# The longest a read waits for a connection to a standby before it asks the primary instead.
READ_POOL_TIMEOUT = 0.2
# After a standby failed a read, this worker reads from the primary for this long (seconds):
# while the standbys are down, one read per worker per READ_POOL_REST asks them again.
READ_POOL_REST = 1.0
# How long the read pool retries a lost connection in the background (seconds) before it leaves
# new connections to the reads that want one: its backoff (1 s, 2 s, 4 s, ...) would otherwise
# keep the reads off a standby for seconds after it is back.
READ_RECONNECT_TIMEOUT = 1.0
# A read connection is replaced after this long (seconds), so that one that fell back to the
# primary (prefer-standby, while the standbys were down) returns to a standby once one is back.
READ_CONNECTION_LIFETIME = 60.0
# A write still unanswered this long after its statement timeout is cancelled (seconds): the
# statement timeout does not cover a commit's wait for the synchronous standby.
COMMIT_WAIT_MARGIN = 1.0
# How often the commit watch looks for writes past their bound (seconds).
COMMIT_WATCH_INTERVAL = 0.2
# A worker asks its standby how far behind it is at most once per this many seconds.
LAG_CHECK_SECONDS = 1.0
# How far behind a standby is (seconds): 0 when it has replayed all the WAL it received (caught
# up; also when it streams nothing yet, just started), else the time since the primary committed
# the last transaction it replayed (unknown, null, when it replayed none since it started). On a
# primary (prefer-standby fell back to one): 0.
STANDBY_LAG = """
select case when not pg_is_in_recovery()
                 or coalesce(pg_last_wal_replay_lsn() >= pg_last_wal_receive_lsn(), true)
            then 0
            else extract(epoch from now() - pg_last_xact_replay_timestamp())::float8
       end as seconds
"""


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


@dataclass
class TimeoutPin:
    """What the pool's new connections found of the server's statement_timeout.

    Behind a transaction pooler the timeout is the database's (pin_statement_timeout). A
    database never pinned (`petstore db upgrade` skipped) is no reason to refuse traffic: its
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
    the client a pid of its own. Through one, the connection prepares no statement, so that a
    statement never runs against a plan that another client prepared on the same server
    connection (transaction pooling). A direct connection keeps its prepared statements.

    Through a pooler the timeout cannot travel with the connection: it is the database's
    default (`petstore db upgrade` pins it). A connection whose server has another value still
    serves (see TimeoutPin); the log says it once for each such connection.
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
    """Create the pools (one per process, and one of the standbys when set) and release
    connections after each request."""
    pin = app.extensions["petstore.timeout_pin"] = TimeoutPin(app.config["DB_STATEMENT_TIMEOUT_MS"])
    app.extensions["petstore.pool"] = open_pool(app.config, pin=pin)
    if app.config.get("READ_DATABASE_URL"):
        read_pool = app.extensions["petstore.read_pool"] = open_pool(
            app.config,
            "petstore-read",
            app.config["READ_DATABASE_URL"],
            pin,
            max_lifetime=READ_CONNECTION_LIFETIME,
            reconnect_timeout=READ_RECONNECT_TIMEOUT,
        )
        app.extensions["petstore.standbys"] = Standbys(
            read_pool, app.config["READ_MAX_LAG_SECONDS"]
        )
    app.extensions["petstore.commit_watch"] = CommitWatch()
    app.teardown_appcontext(_release_conn)


def get_timeout_pin() -> TimeoutPin | None:
    """What the current app's new connections found of the statement timeout (None: no pools)."""
    pin: TimeoutPin | None = current_app.extensions.get("petstore.timeout_pin")
    return pin


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


class Standbys:
    """One worker's reads on the standbys (PETSTORE_READ_DATABASE_URL): their pool, when to leave
    them alone, and whether they were too far behind at the last check."""

    def __init__(self, pool: ConnectionPool[Connection], max_lag: float) -> None:
        self.pool = pool
        self.max_lag = max_lag
        self.rests_until = 0.0  # monotonic
        self.lag_checked_at = -math.inf  # monotonic
        self.behind = False
        # Reads the standbys answered (the primary answers the others).
        self.answered = 0

    def resting(self) -> bool:
        """Whether this worker leaves the standbys alone for now (one failed a moment ago)."""
        return time.monotonic() < self.rests_until

    def rest(self, exc: BaseException) -> None:
        """A standby failed: the primary answers this worker's reads for READ_POOL_REST seconds."""
        log.warning(
            "standby unavailable, reading from the primary: %s: %s", type(exc).__name__, exc
        )
        self.rests_until = time.monotonic() + READ_POOL_REST

    def take(self) -> Connection:
        """A connection to a standby, within READ_POOL_TIMEOUT.

        A standby that restarted cut every idle connection alike: at the first one found cut,
        all the broken ones are dropped (the pool tests its idle connections, each cut one fails
        at once) and new ones are made, rather than one broken connection per read.
        """
        conn = self.pool.getconn(timeout=READ_POOL_TIMEOUT)
        if cut_while_idle(conn):
            self.pool.putconn(conn)
            self.pool.check()
            conn = self.pool.getconn(timeout=READ_POOL_TIMEOUT)
        return conn

    def too_far_behind(self, conn: Connection) -> bool:
        """Whether the standby was more than max_lag seconds behind when last asked (at most once
        per LAG_CHECK_SECONDS per worker, on the read's own connection)."""
        now = time.monotonic()
        if now - self.lag_checked_at >= LAG_CHECK_SECONDS:
            self.lag_checked_at = now
            row = conn.execute(STANDBY_LAG).fetchone()
            lag = None if row is None else row["seconds"]
            behind = lag is None or lag > self.max_lag
            if behind != self.behind:
                log.info(
                    "standby %s: %s s behind, reads %s",
                    "behind" if behind else "caught up",
                    "unknown" if lag is None else f"{lag:.1f}",
                    "go to the primary" if behind else "return to it",
                )
            self.behind = behind
        return self.behind


def read_on_standby_if_any(query: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`query(conn, ...)` on a standby (PETSTORE_READ_DATABASE_URL), else on the primary.

    Only for statements that write nothing and may lag by the replication delay, up to
    READ_MAX_LAG_SECONDS plus LAG_CHECK_SECONDS: a standby further behind is not read from. A
    standby that cannot be reached within READ_POOL_TIMEOUT, or fails the statement, is not an
    error: the primary answers, and this worker leaves the standbys alone for READ_POOL_REST.
    """
    standbys: Standbys | None = current_app.extensions.get("petstore.standbys")
    if standbys is None or standbys.resting():
        return query(get_conn(), *args, **kwargs)
    try:
        conn = standbys.take()
    except (psycopg.OperationalError, psycopg.InterfaceError, PoolTimeout) as exc:
        standbys.rest(exc)
        return query(get_conn(), *args, **kwargs)
    try:
        if not standbys.too_far_behind(conn):
            answer = query(conn, *args, **kwargs)
            standbys.answered += 1
            return answer
    except psycopg.errors.QueryCanceled:
        raise  # the statement timeout: the primary would take as long
    except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
        standbys.rest(exc)
    finally:
        standbys.pool.putconn(conn)
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


class CommitNotReplicated(psycopg.OperationalError):
    """A commit whose wait for the synchronous standby was cancelled: it is on this server only."""


def replication_wait_cancelled(diagnostic: Diagnostic) -> bool:
    """Whether a notice is PostgreSQL's WARNING that a commit stopped waiting for the standby.

    "canceling wait for synchronous replication due to user request" (a cancel), or "canceling
    the wait for synchronous replication and terminating connection ..." (a shutdown), both with
    "The transaction has already committed locally, but might not have been replicated to the
    standby.". Its SQLSTATE is the generic 01000 (or 57P01), so only the English text tells it;
    durable_write does not depend on it (a write the watch cancelled that then returns is one).
    """
    return "wait for synchronous replication" in (diagnostic.message_primary or "")


class CommitWatch:
    """One thread per process that cancels the writes still running past their deadline.

    Cancelling a commit that waits for the synchronous standby ends the wait: PostgreSQL keeps
    the commit locally and says so in a WARNING, which durable_write turns into a 503. The thread
    looks every COMMIT_WATCH_INTERVAL rather than being woken: a write pays a lock and two dict
    operations, never a thread switch.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._due: dict[int, tuple[float, Connection]] = {}
        self._tokens = itertools.count()
        self._thread: threading.Thread | None = None

    def watch(self, conn: Connection, seconds: float) -> int:
        """Cancel `conn`'s statement in `seconds` (give or take the interval) unless unwatch(token)."""
        token = next(self._tokens)
        with self._lock:
            self._due[token] = (time.monotonic() + seconds, conn)
            # Started on first use, in the worker: a thread of gunicorn's master is not forked.
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="petstore-commit-watch", daemon=True
                )
                self._thread.start()
        return token

    def unwatch(self, token: int) -> bool:
        """The write ended: no cancel. Whether it was cancelled meanwhile (the watch took it)."""
        with self._lock:
            return self._due.pop(token, None) is None

    def _run(self) -> None:
        while True:
            time.sleep(COMMIT_WATCH_INTERVAL)
            now = time.monotonic()
            with self._lock:
                expired = [token for token, (due, _) in self._due.items() if due <= now]
                conns = [self._due.pop(token)[1] for token in expired]
            for conn in conns:
                # psycopg's cancel may come from another thread; it connects to the server, so
                # each in a thread of its own: a silent server holds up no other cancel.
                threading.Thread(target=_cancel, args=(conn,), daemon=True).start()


def _cancel(conn: Connection) -> None:
    try:
        conn.cancel()
    except psycopg.Error as exc:  # closed meanwhile, or the server unreachable: nothing to end
        log.warning("could not cancel a write past its bound: %s", exc)


@contextmanager
def durable_write(conn: Connection) -> Iterator[None]:
    """Around a write and its commit: past the block, the commit is on the synchronous standby.

    A commit waits for the synchronous standby, and the statement timeout does not bound that
    wait: PostgreSQL disables it before committing (finish_xact_command in postgres.c). A primary
    whose standby was promoted behind its back (its Patroni dead) makes that wait endless. So a
    write still running DB_STATEMENT_TIMEOUT_MS + COMMIT_WAIT_MARGIN after it began is cancelled.
    A cancelled wait leaves the commit on this server only, which a failover may throw away:
    PostgreSQL says so in a WARNING, and the block raises CommitNotReplicated (a 503 with
    Retry-After; the client's retry with its Idempotency-Key finds the record only where the
    commit is, and idempotency.replay waits for it to be replicated before answering). A block
    that returns after the watch cancelled it raises the same, WARNING or not: in another
    lc_messages the WARNING's text is not recognised, and a cancel that came too late to end
    anything cannot be told from one that ended the wait.
    """
    cancelled: list[str] = []

    def notice(diagnostic: Diagnostic) -> None:
        # Read now: the diagnostic's fields are gone once the callback returns.
        if replication_wait_cancelled(diagnostic):
            cancelled.append(f"{diagnostic.message_primary} ({diagnostic.message_detail})")

    bound = current_app.config["DB_STATEMENT_TIMEOUT_MS"] / 1000 + COMMIT_WAIT_MARGIN
    watch: CommitWatch = current_app.extensions["petstore.commit_watch"]
    conn.add_notice_handler(notice)
    token = watch.watch(conn, bound)
    try:
        yield
    finally:
        watched_out = watch.unwatch(token)
        conn.remove_notice_handler(notice)
        if watched_out:
            # The watch's cancel may still be on its way: no later statement may meet it. The
            # pool replaces a connection that comes back closed.
            conn.close()
    if cancelled:
        raise CommitNotReplicated(cancelled[0])
    if watched_out:
        raise CommitNotReplicated(f"the write was cancelled after {bound:g} s")


def connect(config: dict[str, Any]) -> Connection:
    """A connection outside any request, for the CLI and tests."""
    return psycopg.connect(config["DATABASE_URL"], **connection_kwargs(config))
