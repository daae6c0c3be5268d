"""The bench's database: a scratch database (on a given server or the embedded one), seeded pets,
the servers' PostgreSQL backends, and the plans of the list queries."""

from __future__ import annotations

import contextlib
import statistics
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import conninfo, sql
from psycopg.rows import dict_row

from bench.measure import ROOT, Scenario, log, socket_ports
from petstore import config, db, keys, migrations
from petstore.queries import pets

EMBEDDED_DIR = ROOT / "var" / "bench-postgres"
PAGE = 1000  # the deep page of the paging scenario and of the size check
PAGE_LIMIT = 20
# Seeded statuses, in turn: 40% available, 20% pending, 20% sold, 20% not stated (NULL).
STATUSES = ("available", "pending", "available", "sold", None)

Conn = psycopg.Connection[dict[str, Any]]


@dataclass(frozen=True)
class Table:
    """The seeded pets of one size, as the scenarios need them."""

    size: int
    min_id: int
    max_id: int
    page: int  # the deep page: 1,000, or the middle one of a smaller table
    cursor: int  # `after` of the deep page

    @property
    def deep_path(self) -> str:
        """The URL path of the deep page."""
        return f"/v1/pets?limit={PAGE_LIMIT}&after={self.cursor}"

    @property
    def sample_paths(self) -> tuple[str, ...]:
        """The requests whose answers the floors must give as the service does."""
        return (
            "/v1/pets?limit=20",
            "/v1/pets?limit=100&status=available",
            self.deep_path,
            f"/v1/pets/{self.min_id}",
            "/v1/pets/0",
        )


def scenarios(table: Table, only: Sequence[str] = ()) -> list[Scenario]:
    """The measured scenarios (those named in `only`, when given)."""
    every = [
        Scenario("GET /v1/pets?limit=20", "get.lua", "/v1/pets?limit=20"),
        Scenario(
            "GET /v1/pets?limit=100&status=available",
            "get.lua",
            "/v1/pets?limit=100&status=available",
        ),
        Scenario("deep page, then rel=next", "follow.lua", table.deep_path),
        Scenario("GET /v1/pets/{id}", "pet.lua", "/v1/pets/1"),
        Scenario("POST /v1/pets", "post.lua", "/v1/pets", writes=True),
        Scenario("mixed 80/20 read/write", "mixed.lua", "/v1/pets", writes=True),
    ]
    unknown = set(only) - {each.name for each in every}
    if unknown:
        raise ValueError(f"no such scenario: {', '.join(sorted(unknown))}")
    return [each for each in every if not only or each.name in only]


def size_checks(table: Table) -> list[Scenario]:
    """The pages whose latency must not grow with the table (first one first)."""
    return [
        Scenario("first page", "get.lua", f"/v1/pets?limit={PAGE_LIMIT}"),
        Scenario(f"page {table.page:,}, then rel=next", "follow.lua", table.deep_path),
        Scenario(
            "filtered page (status=available)",
            "get.lua",
            f"/v1/pets?limit={PAGE_LIMIT}&status=available",
        ),
    ]


def redacted(url: str) -> str:
    """A libpq URL or conninfo as a URL without its password, for the report."""
    params = conninfo.conninfo_to_dict(url)
    user = f"{params['user']}@" if params.get("user") else ""
    port = f":{params['port']}" if params.get("port") else ""
    return f"postgresql://{user}{params.get('host', '')}{port}/{params.get('dbname', '')}"


def create_database(server_url: str, name: str) -> str:
    """Create the scratch database afresh on the server; return its conninfo."""
    drop_database(server_url, name)
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(sql.SQL("create database {}").format(sql.Identifier(name)))
    return conninfo.make_conninfo(server_url, dbname=name)


def drop_database(server_url: str, name: str) -> None:
    """Drop the scratch database if it is there."""
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name))
        )


def seed(conn: Conn, size: int) -> Table:
    """Replace the pets with `size` new ones (COPY), statuses mixed; vacuum, analyze, describe."""
    conn.execute("truncate pets restart identity")
    with conn.cursor().copy("copy pets (name, category_id, status) from stdin") as copy:
        for number in range(size):
            copy.write_row((f"pet {number}", number % 100 + 1, STATUSES[number % len(STATUSES)]))
    conn.execute("vacuum analyze pets")
    bounds = conn.execute("select min(id) as low, max(id) as high from pets").fetchone()
    page = max(2, min(PAGE, size // PAGE_LIMIT // 2))
    cursor = conn.execute(
        "select id from pets order by id offset %s limit 1", [(page - 1) * PAGE_LIMIT - 1]
    ).fetchone()
    assert bounds is not None and cursor is not None
    return Table(size, bounds["low"], bounds["high"], page, cursor["id"])


def forget_new_pets(conn: Conn, table: Table) -> None:
    """Delete the pets a run of creates made, then a plain VACUUM, as a deployment's autovacuum
    or its operator would after a bulk delete: the churn step. Never ANALYZE by hand: the
    statistics stay whatever that VACUUM and autovacuum (as shipped) leave, so every later round
    reads through the plan a production table would get (bench/results/README.rst)."""
    if conn.execute("delete from pets where id > %s", [table.max_id]).rowcount:
        conn.execute("vacuum pets")


def churn(conn: Conn, table: Table, creates: int) -> tuple[int, int]:
    """A run of creates, one statement each as the service's are, then forget_new_pets: the
    churn a table goes through between two rounds of `make bench`. (estimate, pets) after it."""
    for number in range(creates):
        conn.execute(
            "insert into pets (name, category_id, status) values (%s, %s, %s)",
            (f"churn {number}", number % 100 + 1, STATUSES[number % len(STATUSES)]),
        )
    forget_new_pets(conn, table)
    return estimated_pets(conn)


def estimated_pets(conn: Conn) -> tuple[int, int]:
    """(the planner's estimate of the pets, as pg_class holds it; the pets there are)."""
    row = conn.execute(
        "select reltuples::bigint as estimate, (select count(*) from pets) as live"
        "  from pg_class where oid = 'pets'::regclass"
    ).fetchone()
    assert row is not None
    return int(row["estimate"]), int(row["live"])


def pool_backends(conn: Conn, app_pids: list[int]) -> list[int] | None:
    """Pids of the PostgreSQL backends whose clients are the processes `app_pids` (one server's:
    every server of a run shares the database), or None when they are not on this machine."""
    rows = conn.execute(
        """
        select pid, client_port
          from pg_stat_activity
         where datname = current_database()
           and application_name = 'petstore'
        """
    ).fetchall()
    ports = socket_ports(app_pids)
    pids = [row["pid"] for row in rows if row["client_port"] in ports]
    return pids if pids and all(Path(f"/proc/{pid}/stat").exists() for pid in pids) else None


class Captured(Exception):
    """Carries the statement a query function tried to run."""

    def __init__(self, query: Any, params: Any) -> None:
        super().__init__("captured")
        self.query = query
        self.params = params


class StatementRecorder:
    """Stands in for a connection: stops a query function at its first statement, keeping it."""

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        """Raise the statement instead of running it."""
        raise Captured(query, params)


def commit_wait(conn: Conn, inserts: int = 200) -> tuple[float, float]:
    """Median µs of createPet's statement (queries.pets.insert_pet, an autocommit insert) with
    synchronous_commit on, as shipped, and off, in turn: the difference is the wait for the
    commit's WAL flush, which every implementation on this database pays. The rows are deleted."""
    timings: dict[str, list[float]] = {"on": [], "off": []}
    before = conn.execute("select coalesce(max(id), 0) as id from pets").fetchone()
    try:
        for _ in range(inserts):
            for setting, found in timings.items():
                conn.execute(sql.SQL("set synchronous_commit = {}").format(sql.Literal(setting)))
                started = time.perf_counter()
                pets.insert_pet(conn, name="Bench", category_id=7, status="available")
                found.append((time.perf_counter() - started) * 1e6)
    finally:
        conn.execute("reset synchronous_commit")
        conn.execute("delete from pets where id > %s", (before["id"] if before else 0,))
    return statistics.median(timings["on"]), statistics.median(timings["off"])


def explain(conn: Conn, query_function: Callable[..., Any], **kwargs: Any) -> tuple[str, str]:
    """(SQL text and parameters, EXPLAIN (ANALYZE, BUFFERS) output) of a query function."""
    try:
        query_function(StatementRecorder(), **kwargs)
    except Captured as captured:
        query, params = captured.query, captured.params
    else:
        raise RuntimeError(f"{query_function.__name__} ran no statement")
    prefix = "explain (analyze, buffers) "
    statement = sql.SQL(prefix) + query if isinstance(query, sql.Composable) else prefix + query
    plan = "\n".join(row["QUERY PLAN"] for row in conn.execute(statement, params).fetchall())
    text = query.as_string(conn) if isinstance(query, sql.Composable) else query
    return f"{textwrap.dedent(text).strip()}\n-- parameters: {params}", plan


def explain_list_queries(conn: Conn, table: Table) -> list[tuple[str, str, str]]:
    """The plans of the three list queries the size check is about."""
    return [
        (
            f"first page (limit={PAGE_LIMIT})",
            *explain(conn, pets.list_pets, after=0, limit=PAGE_LIMIT),
        ),
        (
            f"page {table.page:,} (limit={PAGE_LIMIT})",
            *explain(conn, pets.list_pets, after=table.cursor, limit=PAGE_LIMIT),
        ),
        (
            "filtered page (status=available, limit=100)",
            *explain(conn, pets.list_pets_by_status, status="available", after=0, limit=100),
        ),
    ]


@contextlib.contextmanager
def bench_database(
    server_url: str | None, scratch_database: str
) -> Iterator[tuple[str, str, str, Conn]]:
    """(server URL, database URL, enterprise key, admin connection) of a fresh scratch database
    `scratch_database` on `server_url` (None: the embedded PostgreSQL under var/bench-postgres)."""
    with contextlib.ExitStack() as cleanup:
        if server_url is None:
            from petstore.dev import embedded

            cleanup.callback(embedded.stop, EMBEDDED_DIR)
            log(f"starting the embedded PostgreSQL in var/{EMBEDDED_DIR.name}")
            server_url = embedded.ensure_running(EMBEDDED_DIR)
        database_url = create_database(server_url, scratch_database)
        cleanup.callback(drop_database, server_url, scratch_database)
        with db.connect(config.from_environ({"DATABASE_URL": database_url})) as setup:
            migrations.upgrade(setup)
            key, _row = keys.issue_key(setup, "enterprise", "bench", 10**9, 10**9)
        conn = cleanup.enter_context(
            psycopg.connect(
                database_url,
                autocommit=True,
                row_factory=dict_row,
                application_name="petstore-bench",
            )
        )
        yield server_url, database_url, key, conn
