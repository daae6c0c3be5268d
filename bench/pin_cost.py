"""What applying the statement timeout per transaction would cost through PgBouncer (issue 27 §2).

One statement as the service sends it, against the same statement after a ``SET LOCAL
statement_timeout`` in one pipeline (BEGIN, SET LOCAL, the statement, COMMIT), and the two in the
simple protocol (one query string, no parameters). Rounds alternate so that a loaded machine
weighs on each alike. On a scratch database behind a PgBouncer of its own (the tests' harness):

    .venv/bin/python -m bench.pin_cost postgresql://postgres@127.0.0.1:5432/petstore_test
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
from psycopg.rows import dict_row

from tests.support.databases import empty_database
from tests.support.servers import PgBouncer

STATEMENTS = 1000
ROUNDS = 7
Conn = psycopg.Connection[dict[str, object]]


def extended(conn: Conn) -> None:
    """One statement with a parameter, as the service sends one (autocommit, no prepare)."""
    conn.execute("select relname from pg_class where oid = %s", [1259]).fetchone()


def set_local_pipeline(conn: Conn) -> None:
    """The same, after SET LOCAL, in one pipeline: BEGIN, SET LOCAL, the statement, COMMIT."""
    with conn.pipeline(), conn.transaction():
        conn.execute("set local statement_timeout = 5000")
        cursor = conn.execute("select relname from pg_class where oid = %s", [1259])
    cursor.fetchone()


def simple(conn: Conn) -> None:
    """The statement in the simple protocol (its value written in)."""
    conn.execute(b"select relname from pg_class where oid = 1259", prepare=False).fetchone()


def set_local_simple(conn: Conn) -> None:
    """SET LOCAL and the statement in one simple-protocol query string."""
    cursor = conn.execute(
        b"set local statement_timeout = 5000; select relname from pg_class where oid = 1259",
        prepare=False,
    )
    cursor.nextset()
    cursor.fetchone()


WAYS: dict[str, Callable[[Conn], None]] = {
    "one statement (autocommit, extended protocol)": extended,
    "BEGIN; SET LOCAL; statement; COMMIT in one pipeline": set_local_pipeline,
    "one statement, simple protocol": simple,
    "SET LOCAL; statement in one simple query": set_local_simple,
}


def main(database_url: str) -> None:
    """Print the median µs per statement of each way."""
    rounds: dict[str, list[float]] = {label: [] for label in WAYS}
    with (
        empty_database(database_url, "_pin_cost") as direct,
        tempfile.TemporaryDirectory() as workdir,
        PgBouncer(Path(workdir), direct) as pgbouncer,
        psycopg.connect(
            pgbouncer.url(), autocommit=True, prepare_threshold=None, row_factory=dict_row
        ) as conn,
    ):
        for _ in range(ROUNDS):
            for label, way in WAYS.items():
                started = time.perf_counter()
                for _ in range(STATEMENTS):
                    way(conn)
                rounds[label].append((time.perf_counter() - started) / STATEMENTS * 1e6)
    for label, taken in rounds.items():
        print(f"{label:<55} {statistics.median(taken):6.1f} µs a statement (median of {ROUNDS})")


if __name__ == "__main__":
    main(sys.argv[1])
