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
# streams nothing yet), or on a primary (prefer-standby fell back to one); else the time since the
# primary committed the last transaction it replayed (null when it replayed none yet).
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
    app.extensions["petstore.standbys"] = Standbys(read_pool, app.config["READ_MAX_LAG_SECONDS"])


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
        conn = take_live(standbys.pool, READ_POOL_TIMEOUT)
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
