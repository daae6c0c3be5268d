"""Reads on the standbys (PETSTORE_READ_DATABASE_URL) within the lag bound
(PETSTORE_READ_MAX_LAG_SECONDS): each worker's read pool, when to leave the standbys alone, and
how far behind they are; the primary answers whatever they cannot."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg
from flask import Flask, current_app
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import ConnectionPool, PoolTimeout

from petstore.db import Connection, get_conn, open_pool, take_live

log = logging.getLogger(__name__)

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
# A worker asks its standby how far behind it is at most once per this many seconds.
LAG_CHECK_SECONDS = 1.0
# How far behind a standby is (seconds): 0 when it has replayed all the WAL it received (or
# streams nothing yet), or on a primary (a read URL that names one; prefer-standby skips a
# primary: Standbys.not_a_standby); else the time since the primary committed the last
# transaction it replayed (null when it replayed none yet).
STANDBY_LAG = """
select case when not pg_is_in_recovery()
                 or coalesce(pg_last_wal_replay_lsn() >= pg_last_wal_receive_lsn(), true)
            then 0
            else extract(epoch from now() - pg_last_xact_replay_timestamp())::float8
       end as seconds
"""


def init_app(app: Flask) -> None:
    """With PETSTORE_READ_DATABASE_URL set, open the standbys' pool (one per process)."""
    if not app.config.get("READ_DATABASE_URL"):
        return
    read_pool = open_pool(
        app.config,
        "petstore-read",
        app.config["READ_DATABASE_URL"],
        app.extensions["petstore.timeout_pin"],
        max_lifetime=READ_CONNECTION_LIFETIME,
        reconnect_timeout=READ_RECONNECT_TIMEOUT,
    )
    app.extensions["petstore.read_pool"] = read_pool
    attrs = conninfo_to_dict(app.config["READ_DATABASE_URL"]).get("target_session_attrs")
    app.extensions["petstore.standbys"] = Standbys(
        read_pool, app.config["READ_MAX_LAG_SECONDS"], only_standbys=attrs == "prefer-standby"
    )


class Standbys:
    """One worker's reads on the standbys (PETSTORE_READ_DATABASE_URL): their pool, when to leave
    them alone, and whether they were too far behind at the last check."""

    def __init__(
        self, pool: ConnectionPool[Connection], max_lag: float, only_standbys: bool = False
    ) -> None:
        self.pool = pool
        self.max_lag = max_lag
        # prefer-standby: a server that is no standby is not read from (not_a_standby).
        self.only_standbys = only_standbys
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

    def not_a_standby(self, conn: Connection) -> bool:
        """Whether `conn`'s server says it is not a standby, when only standbys are read from.

        prefer-standby falls back to the first host that takes a connection when no standby
        does: after a failover, that may be a primary deposed behind its back (its Patroni dead,
        its PostgreSQL alive and writable until that Patroni demotes it), whose rows stop at the
        failover. So the primary by DATABASE_URL, which follows the leader lock, answers instead.
        The server reports in_hot_standby itself, at connection and when it is promoted (before
        the answer to the next statement): no round trip. Not reported (a pooler in between, a
        server before PostgreSQL 14): trusted, as before.
        """
        return self.only_standbys and conn.info.parameter_status("in_hot_standby") == "off"

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
    READ_MAX_LAG_SECONDS plus LAG_CHECK_SECONDS: a standby further behind, or a server that is no
    standby behind a prefer-standby URL (Standbys.not_a_standby), is not read from. A
    standby that cannot be reached within READ_POOL_TIMEOUT, or fails the statement, is not an
    error: the primary answers, and this worker leaves the standbys alone for READ_POOL_REST.
    """
    standbys: Standbys | None = current_app.extensions.get("petstore.standbys")
    if standbys is None or standbys.resting():
        return query(get_conn(), *args, **kwargs)
    try:
        conn = take_live(standbys.pool, READ_POOL_TIMEOUT)
    except (psycopg.OperationalError, psycopg.InterfaceError, PoolTimeout) as exc:
        standbys.rest(exc)
        return query(get_conn(), *args, **kwargs)
    try:
        if not standbys.not_a_standby(conn) and not standbys.too_far_behind(conn):
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
