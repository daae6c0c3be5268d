"""`make bench`: the service against the bare-Flask floor and the raw floor under wrk; a report.

For each table size: seed the pets with COPY; start the servers of each storage (gunicorn with
deploy/gunicorn.conf.py on free loopback ports): the service, the bare-Flask floor
(bench/flask_floor.py) and the raw floor (bench/floor.py); check that the floors answer as the
service does, warm each up, then run interleaved rounds of every wrk scenario of bench/wrk/ on
every server. At the first size, also where the distance goes (the service with parts switched
off) and the serving configurations (--configs); at the largest, the cost against table size.
Then the in-process per-request budget (bench/inprocess.py). The report goes to stdout and to
bench/results/<date>-<host>.md, with a PNG per size and bench/results/summary.png.

    .venv/bin/python bench/run.py [--database-url URL] [--sizes 10000,1000000] [--rounds 8]
    .venv/bin/python bench/run.py --in-process-only      # the budget table alone, in a minute

Without --database-url (or DATABASE_URL) it starts the embedded PostgreSQL under var/bench-postgres
(and stops it at the end). Either way it works in a scratch database `petstore_bench`, dropped at
the end. Server logs go to var/bench-logs/. measure.py runs wrk and reads /proc; report.py writes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import psycopg
import redis
from inprocess import budget_table, measure_budget
from measure import (
    GUNICORN_CONFIG,
    ROOT,
    STARTED,
    BenchGunicorn,
    Measure,
    Scenario,
    Target,
    combined,
    ensure_wrk,
    get,
    log,
    peak_rss_kib,
    run_wrk,
)
from psycopg import conninfo, sql
from psycopg.rows import dict_row
from report import (
    FLASK_FLOOR,
    HEADLINE,
    RAW_FLOOR,
    SERVICE,
    Run,
    Server,
    plot_size,
    plot_summary,
    render,
)

from petstore import auth, config, db
from petstore.queries import pets

LOG_DIR = ROOT / "var" / "bench-logs"
EMBEDDED_DIR = ROOT / "var" / "bench-postgres"
PAGE = 1000  # the deep page of the paging scenario and of the size check
PAGE_LIMIT = 20
SIZE_ROUNDS = 5  # at most, of the cost against table size
# Seeded statuses, in turn: 40% available, 20% pending, 20% sold, 20% not stated (NULL).
STATUSES = ("available", "pending", "available", "sold", None)
# The service with flask-limiter switched off; gunicorn calls the factory (literal arguments only).
ABLATION_APP = "petstore:create_app({'RATELIMIT_ENABLED': False})"

Conn = psycopg.Connection[dict[str, Any]]
Answers = dict[str, tuple[int, Any, str | None, bytes]]

MEMORY = (
    Server(SERVICE, "memory", 1),
    Server(FLASK_FLOOR, "memory", 1),
    Server(RAW_FLOOR, "memory", 1),
)
# With a shared storage, deploy/gunicorn.conf.py's default: sync workers, 2 per core + 1.
SHARED_WORKERS = 2 * multiprocessing.cpu_count() + 1
REDIS = (
    Server(SERVICE, "redis", SHARED_WORKERS, threads=1, worker_class="sync"),
    Server(FLASK_FLOOR, "redis", SHARED_WORKERS, threads=1, worker_class="sync"),
    Server(RAW_FLOOR, "redis", SHARED_WORKERS, threads=1, worker_class="sync"),
)
# Where the distance between the service and the floors goes: parts of the service switched off.
DISTANCE = (
    Server(RAW_FLOOR, "memory", 1),
    Server(FLASK_FLOOR, "memory", 1),
    Server(SERVICE, "memory", 1, without=("limiter", "request log")),
    Server(SERVICE, "memory", 1, without=("limiter",)),
    Server(SERVICE, "memory", 1),
)
# Serving configurations for 2 cores with a shared limiter storage (issue 9, target 3).
CONFIGS = (
    Server(SERVICE, "redis", 1, threads=4),
    Server(SERVICE, "redis", 2, threads=4),
    Server(SERVICE, "redis", 2, threads=2),
    Server(SERVICE, "redis", 3, threads=1, worker_class="sync"),
    Server(SERVICE, "redis", 4, threads=1, worker_class="sync"),
    Server(SERVICE, "redis", 5, threads=1, worker_class="sync"),
)


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


def scenarios(table: Table) -> list[Scenario]:
    """The measured scenarios."""
    return [
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


def interrupt(signum: int, frame: FrameType | None) -> None:
    """SIGTERM behaves like Ctrl-C: unwind, stopping every server on the way."""
    raise KeyboardInterrupt


# --- the servers -------------------------------------------------------------------------------


def server_env(server: Server, database_url: str, redis_url: str) -> dict[str, str]:
    """The server's environment: ours without any service setting, plus the ones under test."""
    ours = ("PETSTORE_", "RATELIMIT_", "GUNICORN_")
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(ours) and name not in ("WEB_CONCURRENCY", "BIND", "DATABASE_URL")
    }
    env.update(
        DATABASE_URL=database_url,
        RATELIMIT_STORAGE_URI="memory://" if server.storage == "memory" else redis_url,
        WEB_CONCURRENCY=str(server.workers),
        PETSTORE_THREADS=str(server.threads),
        GUNICORN_WORKER_CLASS=server.worker_class,
    )
    if "request log" in server.without:
        env["PETSTORE_LOG_LEVEL"] = "warning"  # the request log is written at info
    return env


def server_app(server: Server) -> list[str]:
    """gunicorn's app argument (and the path it needs) for a server."""
    if server.app == RAW_FLOOR:
        return ["--pythonpath", "bench", "floor:create_floor()"]
    if server.app == FLASK_FLOOR:
        return ["--pythonpath", "bench", "flask_floor:create_flask_floor()"]
    if "limiter" in server.without:
        return [ABLATION_APP]
    return ["wsgi:app"]


def shown_command(server: Server, env: dict[str, str]) -> str:
    """The server's command line for the report: no paths, no secrets."""
    settings = (
        "RATELIMIT_STORAGE_URI",
        "WEB_CONCURRENCY",
        "PETSTORE_THREADS",
        "GUNICORN_WORKER_CLASS",
        "PETSTORE_LOG_LEVEL",
    )
    command = [".venv/bin/python", "-m", "gunicorn", "-c", GUNICORN_CONFIG, *server_app(server)]
    shown = " ".join(
        f"{name}={env[name] if name != 'RATELIMIT_STORAGE_URI' or env[name] == 'memory://' else 'redis://...'}"
        for name in settings
        if name in env
    )
    return f"DATABASE_URL=<bench database> BIND=127.0.0.1:<port> {shown} {shlex.join(command)}"


def start_servers(
    args: argparse.Namespace,
    stack: contextlib.ExitStack,
    servers: tuple[Server, ...],
    database_url: str,
    table: Table,
    run: Run,
) -> dict[Server, BenchGunicorn]:
    """Start each server on a free port, stopped when `stack` closes; note its command."""
    masters: dict[Server, BenchGunicorn] = {}
    for server in servers:
        env = server_env(server, database_url, args.redis_url)
        run.commands.setdefault(server.label, shown_command(server, env))
        name = f"{table.size}-{server.label}".replace(" ", "-").replace("://", "").replace("×", "x")
        log_path = LOG_DIR / f"{name}.log"
        gunicorn = BenchGunicorn(server_app(server), env, log_path, server.workers, server.threads)
        masters[server] = stack.enter_context(gunicorn)
    return masters


def sample_answers(port: int, key: str, table: Table) -> Answers:
    """Status, parsed JSON, Link header and raw body of a few requests."""
    paths = [
        "/v1/pets?limit=20",
        "/v1/pets?limit=100&status=available",
        table.deep_path,
        f"/v1/pets/{table.min_id}",
        "/v1/pets/0",
    ]
    answers = {}
    for path in paths:
        status, headers, body = get(port, path, key)
        answers[path] = (status, json.loads(body), headers.get("Link"), body)
    return answers


def compare_answers(reference: Answers, answers: Answers, label: str, run: Run) -> None:
    """Note where a server answers differently from the service (status, JSON, Link, bytes)."""
    for path, (status, body, link, raw) in answers.items():
        want = reference[path]
        if status != want[0] or (status < 400 and (body, link) != want[1:3]):
            run.notes.append(f"{label} answers `{path}` unlike the service: {status} {raw[:100]!r}")
        elif status < 400 and raw != want[3]:
            run.notes.append(f"{label}: the same JSON as the service for `{path}`, other bytes")


def check_and_warm_up(
    args: argparse.Namespace,
    conn: Conn,
    masters: dict[Server, BenchGunicorn],
    key: str,
    table: Table,
    run: Run,
) -> dict[Server, Target]:
    """Compare each server's answers with the first one's, warm it up; wrk's targets."""
    wrk_env = {
        **os.environ,
        "BENCH_KEY": key,
        "BENCH_MIN_ID": str(table.min_id),
        "BENCH_MAX_ID": str(table.max_id),
    }
    targets: dict[Server, Target] = {}
    reference: Answers = {}
    for server, running in masters.items():
        answers = sample_answers(running.port, key, table)
        if reference:
            compare_answers(reference, answers, f"{server.label} ({table.size:,} pets)", run)
        reference = reference or answers
        targets[server] = Target(running.port, running.worker_pids(), wrk_env)
        warm_up = Scenario("warm-up", "mixed.lua", "/v1/pets")
        run_wrk(targets[server], warm_up, args.warmup, args.connections, args.threads)
        forget_new_pets(conn, table)
    return targets


def interleaved(
    args: argparse.Namespace,
    conn: Conn,
    table: Table,
    targets: dict[Server, Target],
    chosen: list[Scenario],
    rounds: int,
    keep: Callable[[Server, Scenario, Measure], None],
) -> None:
    """`rounds` rounds, each running every scenario on every server in turn."""
    for number in range(rounds):
        log(f"{table.size:>9,} pets  round {number + 1} of {rounds}")
        for scenario in chosen:
            for server, target in targets.items():
                measure = run_wrk(
                    target,
                    scenario,
                    args.duration,
                    args.connections,
                    args.threads,
                    pool_backends(conn),
                )
                keep(server, scenario, measure)
                if scenario.writes:
                    forget_new_pets(conn, table)


def say(table: Table, label: str, name: str, measures: list[Measure]) -> None:
    """One line of progress for a server and scenario over its rounds."""
    whole = combined(measures)
    errors = f"  {whole.errors} errors" if whole.errors else ""
    log(
        f"{table.size:>9,} pets  {label:<36} {name:<40} {whole.rps:>6,.0f} req/s  "
        f"p99 {whole.p99_ms:6.2f} ms  app {whole.app_us or 0:5,.0f} µs/req{errors}"
    )


def bench_group(
    args: argparse.Namespace,
    conn: Conn,
    database_url: str,
    key: str,
    table: Table,
    servers: tuple[Server, ...],
    run: Run,
) -> None:
    """The service and both floors of one storage: interleaved rounds of every scenario."""
    redis.Redis.from_url(args.redis_url, socket_timeout=5).flushdb()
    with contextlib.ExitStack() as stack:
        masters = start_servers(args, stack, servers, database_url, table, run)
        targets = check_and_warm_up(args, conn, masters, key, table, run)

        def keep(server: Server, scenario: Scenario, measure: Measure) -> None:
            run.rounds.setdefault((table.size, server.label, scenario.name), []).append(measure)
            if measure.errors:
                run.notes.append(
                    f"{server.label}, {table.size:,} pets, {scenario.name}: {measure.errors} errors"
                )

        interleaved(args, conn, table, targets, scenarios(table), args.rounds, keep)
        for scenario in scenarios(table):
            for server in servers:
                say(
                    table,
                    server.label,
                    scenario.name,
                    run.rounds[(table.size, server.label, scenario.name)],
                )
        if table.size == max(args.sizes) and servers == MEMORY:
            check_sizes(args, conn, table, targets, run)
        for server, running in masters.items():
            run.rss_kib[(table.size, server.label)] = [
                peak_rss_kib(pid) for pid in running.worker_pids()
            ]


def where_the_distance_goes(
    args: argparse.Namespace, conn: Conn, database_url: str, key: str, table: Table, run: Run
) -> None:
    """The floors, the service without the limiter and the request log, without the limiter, whole."""
    reads = [
        s for s in scenarios(table) if s.name in ("GET /v1/pets?limit=20", "GET /v1/pets/{id}")
    ]
    run.distance_servers = DISTANCE
    run.distance_size = table.size
    side_by_side(
        args, conn, database_url, key, table, run, DISTANCE, reads, args.rounds, run.distance
    )


def serving_configs(
    args: argparse.Namespace, conn: Conn, database_url: str, key: str, table: Table, run: Run
) -> None:
    """The service on redis:// under each gunicorn configuration: limit=20 and POST."""
    chosen = [s for s in scenarios(table) if s.name in ("GET /v1/pets?limit=20", "POST /v1/pets")]
    redis.Redis.from_url(args.redis_url, socket_timeout=5).flushdb()
    rounds = args.config_rounds
    side_by_side(args, conn, database_url, key, table, run, CONFIGS, chosen, rounds, run.configs)


def side_by_side(
    args: argparse.Namespace,
    conn: Conn,
    database_url: str,
    key: str,
    table: Table,
    run: Run,
    servers: tuple[Server, ...],
    chosen: list[Scenario],
    rounds: int,
    into: dict[tuple[str, str], list[Measure]],
) -> None:
    """Start `servers`, run `rounds` interleaved rounds of `chosen` on them, keep each measure
    in `into` by (scenario, server label), and say how each did."""
    with contextlib.ExitStack() as stack:
        masters = start_servers(args, stack, servers, database_url, table, run)
        targets = check_and_warm_up(args, conn, masters, key, table, run)

        def keep(server: Server, scenario: Scenario, measure: Measure) -> None:
            into.setdefault((scenario.name, server.label), []).append(measure)

        interleaved(args, conn, table, targets, chosen, rounds, keep)
    for (name, label), measures in into.items():
        say(table, label, name, measures)


def check_sizes(
    args: argparse.Namespace, conn: Conn, table: Table, targets: dict[Server, Target], run: Run
) -> None:
    """Latency of the first, the deep and a filtered page at one connection: service, raw floor.

    In rounds of one second, each page on each server in turn; each page keeps the median of
    its rounds' medians.
    """
    rounds: dict[tuple[str, str], list[Measure]] = {}
    chosen = (MEMORY[0], MEMORY[2])
    for _round in range(min(args.rounds, SIZE_ROUNDS)):
        for check in size_checks(table):
            for server in chosen:
                measure = run_wrk(targets[server], check, 1, 1, 1, pool_backends(conn))
                rounds.setdefault((server.label, check.name), []).append(measure)
    for (label, name), measures in rounds.items():
        run.single[(label, name)] = combined(measures)
        log(
            f"{table.size:>9,} pets  {label:<22} 1 connection, {name:<32} "
            f"p50 {run.single[(label, name)].p50_ms:6.2f} ms (median of {len(measures)} rounds)"
        )


# --- database ----------------------------------------------------------------------------------


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
    """Delete the pets the benchmark created, so that every run sees the seeded table."""
    if conn.execute("delete from pets where id > %s", [table.max_id]).rowcount:
        conn.execute("vacuum pets")


def pool_backends(conn: Conn) -> list[int] | None:
    """Pids of the servers' PostgreSQL backends, or None when they are not on this machine."""
    rows = conn.execute(
        """
        select pid
          from pg_stat_activity
         where datname = current_database()
           and application_name = 'petstore'
        """
    ).fetchall()
    pids = [row["pid"] for row in rows]
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
def bench_database(args: argparse.Namespace) -> Iterator[tuple[str, str, str, Conn]]:
    """(server URL, database URL, enterprise key, admin connection) of a fresh scratch database."""
    with contextlib.ExitStack() as cleanup:
        server_url = args.database_url
        if server_url is None:
            from petstore import embedded

            cleanup.callback(embedded.stop, EMBEDDED_DIR)
            log(f"starting the embedded PostgreSQL in var/{EMBEDDED_DIR.name}")
            server_url = embedded.ensure_running(EMBEDDED_DIR)
        database_url = create_database(server_url, args.scratch_database)
        cleanup.callback(drop_database, server_url, args.scratch_database)
        with db.connect(config.from_environ({"DATABASE_URL": database_url})) as setup:
            db.upgrade(setup)
            key, _row = auth.issue_key(setup, "enterprise", "bench", 10**9, 10**9)
        conn = cleanup.enter_context(
            psycopg.connect(
                database_url,
                autocommit=True,
                row_factory=dict_row,
                application_name="petstore-bench",
            )
        )
        yield server_url, database_url, key, conn


# --- the run -----------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--database-url",
        default=os.environ.get("DATABASE_URL") or None,
        help="PostgreSQL server to make the scratch database on "
        "(default: $DATABASE_URL, else the embedded one under var/bench-postgres)",
    )
    parser.add_argument(
        "--scratch-database",
        default="petstore_bench",
        help="the database made afresh for the run, and dropped after it (default petstore_bench)",
    )
    parser.add_argument(
        "--redis-url", default="redis://127.0.0.1:6379/9", help="emptied before use"
    )
    parser.add_argument(
        "--sizes",
        default=[10_000, 1_000_000],
        type=lambda text: sorted(int(each) for each in text.split(",")),
        help="pets in the table, comma-separated (default 10000,1000000); redis:// and the "
        "serving configurations run at the first size only",
    )
    # Short rounds, many of them: background load comes and goes, and a ratio's median over
    # many short interleaved rounds moves less than over a few long ones in the same time.
    parser.add_argument("--duration", type=int, default=1, help="seconds per round (default 1)")
    parser.add_argument(
        "--rounds", type=int, default=8, help="interleaved rounds per scenario (default 8)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="seconds of warm-up per server")
    parser.add_argument("--connections", type=int, default=8, help="wrk connections (default 8)")
    parser.add_argument("--threads", type=int, default=1, help="wrk threads (default 1)")
    parser.add_argument(
        "--configs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the serving configurations table (default: on)",
    )
    parser.add_argument(
        "--config-rounds", type=int, default=4, help="rounds of the configurations (default 4)"
    )
    parser.add_argument(
        "--in-process-only",
        action="store_true",
        help="only the in-process per-request budget table, printed (no wrk, no servers)",
    )
    parser.add_argument(
        "--in-process-requests", type=int, default=400, help="requests per in-process round"
    )
    parser.add_argument(
        "--in-process-rounds", type=int, default=8, help="in-process rounds (default 8)"
    )
    parser.add_argument(
        "--output", type=Path, default=ROOT / "bench" / "results", help="report directory"
    )
    args = parser.parse_args()
    if args.duration < 1 or args.warmup < 1 or args.rounds < 1 or args.config_rounds < 1:
        parser.error("--duration, --warmup, --rounds, --config-rounds: at least 1")
    if min(args.sizes) < 2 * PAGE_LIMIT:
        parser.error(f"--sizes: at least {2 * PAGE_LIMIT} pets")
    return args


def main() -> int:
    """Run the benchmark; write and print the report."""
    args = parse_args()
    signal.signal(signal.SIGTERM, interrupt)
    try:
        if args.in_process_only:
            return in_process_only(args)
        return bench(args)
    except KeyboardInterrupt:
        log("interrupted: stopped what the run had started")
        return 130


def budget(args: argparse.Namespace, database_url: str, key: str) -> str:
    """The in-process per-request budget table."""
    log(
        f"in-process budget: {args.in_process_rounds} rounds of "
        f"{args.in_process_requests} direct WSGI calls per app"
    )
    redis.Redis.from_url(args.redis_url, socket_timeout=5).flushdb()
    found, validation = measure_budget(
        database_url, args.redis_url, key, args.in_process_requests, args.in_process_rounds
    )
    return budget_table(found, validation, args.in_process_requests, args.in_process_rounds)


def in_process_only(args: argparse.Namespace) -> int:
    """Seed the smallest size and print the in-process budget table."""
    with bench_database(args) as (_server_url, database_url, key, conn):
        log(f"seeding {min(args.sizes):,} pets (COPY)")
        seed(conn, min(args.sizes))
        table = budget(args, database_url, key)
    print(f"\n{table}\n")
    log("done")
    return 0


def bench(args: argparse.Namespace) -> int:
    """Set up, measure, write the report; stop what was started, however it ends."""
    ensure_wrk()
    run = Run(sizes=args.sizes)
    run.groups = [
        (f"memory:// — {MEMORY[0].label} against the floors", MEMORY),
        (f"redis:// — {REDIS[0].label} against the floors", REDIS),
    ]
    with bench_database(args) as (server_url, database_url, key, conn):
        for size in args.sizes:
            log(f"seeding {size:,} pets (COPY)")
            table = seed(conn, size)
            run.pages[size] = table.page
            run.scenario_names = [s.name for s in scenarios(table)]
            first = size == min(args.sizes)
            for _title, servers in run.groups if first else run.groups[:1]:
                bench_group(args, conn, database_url, key, table, servers, run)
            if first:
                where_the_distance_goes(args, conn, database_url, key, table, run)
                if args.configs:
                    serving_configs(args, conn, database_url, key, table, run)
        log(f"EXPLAIN (ANALYZE, BUFFERS) of the list queries at {table.size:,} pets")
        run.plans = explain_list_queries(conn, table)
        seed(conn, min(args.sizes))
        run.budget = budget(args, database_url, key)
        facts = machine_facts(conn, args.database_url)
    if not any("unlike the service" in note or "other bytes" in note for note in run.notes):
        run.notes.insert(
            0,
            "Both floors answered the sampled requests as the service did: status, body bytes, "
            "Link (and the status of a 404).",
        )
    note_background_load(run)
    write_report(args, run, facts)
    return 0


def write_report(args: argparse.Namespace, run: Run, facts: dict[str, str]) -> None:
    """The Markdown report and its plots, beside each other in --output."""
    args.output.mkdir(parents=True, exist_ok=True)
    stem = f"{time.strftime('%Y-%m-%d')}-{socket.gethostname()}"
    pictures = [plot_size(run, size, args.output / f"{stem}-{size}.png") for size in args.sizes]
    pictures.insert(0, plot_summary(run, args.output / "summary.png"))
    invocation = (
        f".venv/bin/python bench/run.py --sizes {','.join(str(size) for size in args.sizes)} "
        f"--duration {args.duration} --rounds {args.rounds} --warmup {args.warmup} "
        f"--connections {args.connections} --threads {args.threads}"
        + ("" if args.configs else " --no-configs")
        + "    # make bench runs it with the defaults"
    )
    settings = {
        "threads": str(args.threads),
        "connections": str(args.connections),
        "rounds": str(args.rounds),
        "duration": str(args.duration),
        "warmup": str(args.warmup),
        "invocation": (f"DATABASE_URL={facts['database']} " if facts["database"] else "")
        + invocation,
        "size_service": MEMORY[0].label,
        "size_floor": MEMORY[2].label,
    }
    path = args.output / f"{stem}.md"
    previous = previous_report(args.output)
    report = render(run, facts, settings, time.monotonic() - STARTED, pictures, previous)
    path.write_text(report)
    print(f"\n{report}")
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    log(f"report written to {shown}, plots beside it ({', '.join(p.name for p in pictures)})")


def previous_report(directory: Path) -> Path | None:
    """The newest report in `directory` with the bare-Flask floor (read before it is replaced)."""
    reports = sorted(directory.glob("*.md"), key=lambda each: each.stat().st_mtime)
    found = [each for each in reports if HEADLINE in each.read_text(errors="replace")]
    return found[-1] if found else None


def machine_facts(conn: Conn, server_url: str | None) -> dict[str, str]:
    """What the report says about the machine and the code (no paths, no secrets)."""
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    models = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")]
    mem_kib = int(Path("/proc/meminfo").read_text().split()[1])
    version = conn.execute("show server_version").fetchone()

    def output(*command: str) -> str:
        done = subprocess.run(
            command, cwd=ROOT, capture_output=True, text=True, timeout=10, check=False
        )
        return (done.stdout + done.stderr).strip()

    dirty = output("git", "status", "--porcelain", "petstore", "wsgi.py", "deploy")
    return {
        "cpu": models[0] if models else platform.machine(),
        "cores": str(os.cpu_count()),
        "memory": f"{mem_kib / 2**20:.0f} GiB",
        "postgres": f"PostgreSQL {version['server_version'].split()[0] if version else '?'}"
        + (" (the machine's)" if server_url else " (embedded)"),
        "python": f"Python {platform.python_version()}",
        "wrk": "wrk " + output("wrk", "-v").split(" [")[0].split("/")[-1],
        "commit": output("git", "rev-parse", "--short", "HEAD")
        + (" plus uncommitted changes to the service" if dirty else ""),
        "database": redacted(server_url) if server_url else "",
    }


def note_background_load(run: Run) -> None:
    """Say how many measures ran while other processes kept the machine busy."""
    every = [m for measures in run.rounds.values() for m in measures]
    busy = [m.other_cpu / m.seconds for m in every if m.seconds]
    noisy = [share for share in busy if share > 0.25]
    if noisy:
        run.notes.append(
            f"Other processes on the machine used more than a quarter of a core during "
            f"{len(noisy)} of {len(busy)} measures (up to {max(noisy):.2f} cores): those numbers "
            "are noisy; the CPU per request (from /proc) is steadier than requests/s."
        )


if __name__ == "__main__":
    sys.exit(main())
