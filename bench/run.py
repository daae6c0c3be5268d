"""`make bench`: the service against the bare-Flask floor and the raw floor under wrk; a report.

    .venv/bin/python -m bench.run [--database-url URL] [--sizes 10000,1000000] [--rounds 8]
    .venv/bin/python -m bench.run --configs-only        # the serving configurations alone
    .venv/bin/python -m bench.run --in-process-only     # the budget table alone, in a minute

For each table size: seed the pets with COPY (database.py); start the servers of each group
(servers.py: gunicorn with deploy/gunicorn.conf.py on free loopback ports, behind the shipped
nginx site for the headline): the service, the bare-Flask floor (bench/flask_floor.py) and the
raw floor (bench/floor.py); check that the floors answer as the service does, warm each up, then
run interleaved rounds of every wrk scenario of bench/wrk/ on every server (measure.py: wrk and
the CPU of each process from /proc). The headline is the production path: redis://, the default
serving configuration, through nginx; the same servers straight to gunicorn come second, then
memory://. At the first size, also where the distance goes (the service with parts switched
off) and the serving configurations through nginx; at the largest, the cost against table size.
Then the in-process per-request budget (inprocess.py). The report (report.py) goes to stdout and
to bench/results/<date>-<host>.md, with a PNG per size and bench/results/summary.png.

Without --database-url (or DATABASE_URL) it starts the embedded PostgreSQL under var/bench-postgres
(and stops it at the end). Either way it works in a scratch database `petstore_bench`, dropped at
the end. Server logs go to var/bench-logs/.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import multiprocessing
import os
import shlex
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TypeVar

import redis

from bench.database import (
    PAGE_LIMIT,
    Conn,
    Table,
    bench_database,
    estimated_pets,
    explain_list_queries,
    forget_new_pets,
    pool_backends,
    seed,
)
from bench.inprocess import budget_table, measure_budget
from bench.machine import machine_facts, note_background_load
from bench.measure import (
    ROOT,
    STARTED,
    Measure,
    Scenario,
    Target,
    combined,
    ensure_program,
    local_redis_pids,
    log,
    peak_rss_kib,
    run_wrk,
)
from bench.plots import plot_size, plot_summary
from bench.report import Run, previous_report, render
from bench.servers import (
    FLASK_FLOOR,
    RAW_FLOOR,
    SERVICE,
    Answers,
    Running,
    Server,
    compare_answers,
    sample_answers,
    start_servers,
)

SIZE_ROUNDS = 5  # at most, of the cost against table size
# Paired rounds of the headline: fewer leave the median of the rounds' ratios at the mercy of
# one or two rounds that background load disturbed (bench/results/README.rst).
MIN_ROUNDS = 5
T = TypeVar("T")

# deploy/gunicorn.conf.py's default with a shared storage: sync workers, one per core + 1.
SHARED_WORKERS = multiprocessing.cpu_count() + 1
# The headline: the production path, redis:// and the default serving configuration, through
# the shipped nginx site (one nginx per server).
PRODUCTION = tuple(
    Server(app, "redis", SHARED_WORKERS, threads=1, worker_class="sync", nginx=True)
    for app in (SERVICE, FLASK_FLOOR, RAW_FLOOR)
)
# The same servers, wrk straight to gunicorn.
REDIS = tuple(
    Server(app, "redis", SHARED_WORKERS, threads=1, worker_class="sync")
    for app in (SERVICE, FLASK_FLOOR, RAW_FLOOR)
)
# memory://'s default: one gthread worker × 4 threads.
MEMORY = tuple(Server(app, "memory", 1) for app in (SERVICE, FLASK_FLOOR, RAW_FLOOR))
# Where the distance between the service and the floors goes: parts of the service switched off.
DISTANCE = (
    Server(RAW_FLOOR, "memory", 1),
    Server(FLASK_FLOOR, "memory", 1),
    Server(SERVICE, "memory", 1, without=("limiter", "request log")),
    Server(SERVICE, "memory", 1, without=("limiter",)),
    Server(SERVICE, "memory", 1),
)
# Serving configurations for 2 cores with redis://, through nginx (issue 20, target 1): sync
# workers (a new connection from nginx for every request) against gthread workers, which keep
# nginx's upstream connections alive (GUNICORN_KEEPALIVE); gunicorn's other worker classes need
# gevent, eventlet or tornado and a psycopg that cooperates with them.
CONFIGS = (
    Server(SERVICE, "redis", 3, threads=1, worker_class="sync", nginx=True),
    Server(SERVICE, "redis", 5, threads=1, worker_class="sync", nginx=True),
    Server(SERVICE, "redis", 3, threads=1, nginx=True),
    Server(SERVICE, "redis", 5, threads=1, nginx=True),
    Server(SERVICE, "redis", 3, threads=2, nginx=True),
    Server(SERVICE, "redis", 2, threads=4, nginx=True),
)


def scenarios(table: Table, only: list[str] | None = None) -> list[Scenario]:
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
    unknown = set(only or ()) - {each.name for each in every}
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


def interrupt(signum: int, frame: FrameType | None) -> None:
    """SIGTERM behaves like Ctrl-C: unwind, stopping every server on the way."""
    raise KeyboardInterrupt


def check_and_warm_up(
    args: argparse.Namespace,
    conn: Conn,
    masters: dict[Server, Running],
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
        answers = sample_answers(running.port, key, [*table.sample_paths])
        if reference:
            label = f"{server.label} ({table.size:,} pets)"
            run.notes += compare_answers(reference, answers, label)
        reference = reference or answers
        targets[server] = Target(running.port, running.app_pids, running.nginx_pids, wrk_env)
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
    """`rounds` paired rounds: each runs every scenario on every server once, in turn."""
    redis_pids = local_redis_pids(args.redis_url)
    for number in range(rounds):
        log(f"{table.size:>9,} pets  round {number + 1} of {rounds}")
        for scenario in chosen:
            for server, target in rotation(list(targets.items()), number):
                measure = run_wrk(
                    target,
                    scenario,
                    args.duration,
                    args.connections,
                    args.threads,
                    pool_backends(conn, target.app_pids()),
                    redis_pids if server.storage == "redis" else None,
                )
                keep(server, scenario, measure)
                if scenario.writes:
                    forget_new_pets(conn, table)


def rotation(servers: list[T], number: int) -> list[T]:
    """The order of the servers in round `number`: shifted by one each round, so that no server
    always runs first on a scenario (after the pets of a write scenario were deleted) or last."""
    shift = number % len(servers) if servers else 0
    return servers[shift:] + servers[:shift]


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
    rounds: int,
    run: Run,
) -> None:
    """The service and both floors of one group: interleaved rounds of every scenario."""
    redis.Redis.from_url(args.redis_url, socket_timeout=5).flushdb()
    with contextlib.ExitStack() as stack:
        masters = start_servers(
            stack, servers, database_url, args.redis_url, str(table.size), run.commands
        )
        targets = check_and_warm_up(args, conn, masters, key, table, run)

        def keep(server: Server, scenario: Scenario, measure: Measure) -> None:
            run.rounds.setdefault((table.size, server.label, scenario.name), []).append(measure)
            if servers[0] == PRODUCTION[0] and "status=" in scenario.name:
                run.estimates.setdefault((table.size, server.label, scenario.name), []).append(
                    estimated_pets(conn)
                )
            if measure.errors:
                run.notes.append(
                    f"{server.label}, {table.size:,} pets, {scenario.name}: {measure.errors} errors"
                )

        chosen = scenarios(table, args.scenarios)
        interleaved(args, conn, table, targets, chosen, rounds, keep)
        for scenario in chosen:
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
        args, conn, database_url, key, table, run, DISTANCE, reads, args.second_rounds, run.distance
    )


def serving_configs(
    args: argparse.Namespace, conn: Conn, database_url: str, key: str, table: Table, run: Run
) -> None:
    """The service on redis:// under each gunicorn configuration: limit=20 and POST, or the
    scenarios --scenario names."""
    chosen = scenarios(table, args.scenarios or ["GET /v1/pets?limit=20", "POST /v1/pets"])
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
        masters = start_servers(
            stack, servers, database_url, args.redis_url, str(table.size), run.commands
        )
        targets = check_and_warm_up(args, conn, masters, key, table, run)

        def keep(server: Server, scenario: Scenario, measure: Measure) -> None:
            into.setdefault((scenario.name, server.label), []).append(measure)

        interleaved(args, conn, table, targets, chosen, rounds, keep)
    for (name, label), measures in into.items():
        say(table, label, name, measures)


def table_sizes(
    args: argparse.Namespace, conn: Conn, server_url: str, database_url: str, key: str, run: Run
) -> None:
    """The same service on the first size's table and on --size-comparison's, each through its
    own nginx, in paired rounds of the read scenarios."""
    small = seed(conn, min(args.sizes))
    larger = argparse.Namespace(
        database_url=server_url, scratch_database=f"{args.scratch_database}_large"
    )
    servers = tuple(
        dataclasses.replace(PRODUCTION[0], pets=size) for size in (small.size, args.size_comparison)
    )
    run.size_pair = servers
    redis.Redis.from_url(args.redis_url, socket_timeout=5).flushdb()
    with contextlib.ExitStack() as stack:
        _server_url, large_url, large_key, large_conn = stack.enter_context(bench_database(larger))
        log(f"seeding {args.size_comparison:,} pets (COPY) beside the {small.size:,}")
        large = seed(large_conn, args.size_comparison)
        sides = {
            servers[0]: (database_url, key, small, conn),
            servers[1]: (large_url, large_key, large, large_conn),
        }
        targets, chosen = {}, {}
        for server, (url, its_key, table, its_conn) in sides.items():
            running = start_servers(
                stack, (server,), url, args.redis_url, str(table.size), run.commands
            )[server]
            env = {
                **os.environ,
                "BENCH_KEY": its_key,
                "BENCH_MIN_ID": str(table.min_id),
                "BENCH_MAX_ID": str(table.max_id),
            }
            targets[server] = Target(running.port, running.app_pids, running.nginx_pids, env)
            warm_up = Scenario("warm-up", "mixed.lua", "/v1/pets")
            run_wrk(targets[server], warm_up, args.warmup, args.connections, args.threads)
            forget_new_pets(its_conn, table)
            # The deep page: the one before the last, at either size.
            near_end = dataclasses.replace(table, cursor=table.max_id - 2 * PAGE_LIMIT)
            chosen[server] = [each for each in scenarios(near_end) if not each.writes]
        names = [each.name for each in chosen[servers[0]]]
        run.scenario_names = list(dict.fromkeys([*run.scenario_names, *names]))
        redis_pids = local_redis_pids(args.redis_url)
        for number in range(args.rounds):
            log(f"table sizes  round {number + 1} of {args.rounds}")
            for index in range(len(chosen[servers[0]])):
                for server in rotation(list(servers), number):
                    scenario = chosen[server][index]
                    measure = run_wrk(
                        targets[server],
                        scenario,
                        args.duration,
                        args.connections,
                        args.threads,
                        pool_backends(sides[server][3], targets[server].app_pids()),
                        redis_pids,
                    )
                    run.rounds.setdefault((small.size, server.label, scenario.name), []).append(
                        measure
                    )
        for server in servers:
            for scenario in chosen[server]:
                say(
                    small,
                    server.label,
                    scenario.name,
                    run.rounds[(small.size, server.label, scenario.name)],
                )


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
                target = targets[server]
                measure = run_wrk(target, check, 1, 1, 1, pool_backends(conn, target.app_pids()))
                rounds.setdefault((server.label, check.name), []).append(measure)
    for (label, name), measures in rounds.items():
        run.single[(label, name)] = combined(measures)
        log(
            f"{table.size:>9,} pets  {label:<22} 1 connection, {name:<32} "
            f"p50 {run.single[(label, name)].p50_ms:6.2f} ms (median of {len(measures)} rounds)"
        )


# --- the run -----------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.run", description=(__doc__ or "").splitlines()[0]
    )
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
        "--rounds",
        type=int,
        default=8,
        help=f"paired rounds per scenario, at least {MIN_ROUNDS} (default 8)",
    )
    parser.add_argument("--warmup", type=int, default=2, help="seconds of warm-up per server")
    parser.add_argument("--connections", type=int, default=8, help="wrk connections (default 8)")
    parser.add_argument("--threads", type=int, default=1, help="wrk threads (default 1)")
    parser.add_argument(
        "--second-rounds",
        type=int,
        default=4,
        help="rounds of the tables after the headline and memory:// at the first size: redis:// "
        "straight to gunicorn, memory:// at the larger sizes, where the distance goes (default 4)",
    )
    parser.add_argument(
        "--configs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the serving configurations table through nginx (default: on)",
    )
    parser.add_argument(
        "--baseline",
        metavar="COMMIT",
        help="also serve the service as built at COMMIT (git archive into var/bench-baseline/) "
        "in the production path's rotation, and report the service against it",
    )
    parser.add_argument(
        "--commit-wait",
        action="store_true",
        help="also serve the service with synchronous_commit off in the production path's "
        "rotation: what a commit's wait for its WAL flush costs each scenario",
    )
    parser.add_argument(
        "--size-comparison",
        type=int,
        metavar="PETS",
        help="also serve the production path's service on a second database of PETS pets beside "
        "the first size's, and compare the two in paired rounds of the read scenarios",
    )
    parser.add_argument(
        "--production-only",
        action="store_true",
        help="only the production path (the headline) at the first size: no other group, "
        "distance, configurations, plans or in-process budget",
    )
    parser.add_argument(
        "--scenario",
        action="append",
        dest="scenarios",
        metavar="NAME",
        help="only this scenario (its name as the report gives it; repeat for more; default: all)",
    )
    parser.add_argument(
        "--configs-only",
        action="store_true",
        help="only the serving configurations through nginx, at the first size, into "
        "<date>-<host>-configs.md",
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
    counts = (args.duration, args.warmup, args.second_rounds, args.config_rounds)
    if min(counts) < 1:
        parser.error("--duration, --warmup, --second-rounds, --config-rounds: at least 1")
    if args.rounds < MIN_ROUNDS:
        parser.error(
            f"--rounds: at least {MIN_ROUNDS} (paired rounds, see bench/results/README.rst)"
        )
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
        if args.configs_only:
            return configs_only(args)
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


def configs_only(args: argparse.Namespace) -> int:
    """Seed the smallest size, measure the serving configurations through nginx, report them."""
    for program in ("wrk", "nginx"):
        ensure_program(program)
    run = Run(sizes=[min(args.sizes)])
    with bench_database(args) as (_server_url, database_url, key, conn):
        log(f"seeding {min(args.sizes):,} pets (COPY)")
        table = seed(conn, min(args.sizes))
        run.pages[table.size] = table.page
        serving_configs(args, conn, database_url, key, table, run)
        facts = machine_facts(conn, args.database_url)
    note_background_load(run)
    write_report(args, run, facts)
    return 0


def bench(args: argparse.Namespace) -> int:
    """Set up, measure, write the report; stop what was started, however it ends."""
    for program in ("wrk", "nginx"):
        ensure_program(program)
    production = PRODUCTION
    if args.baseline:
        production += (dataclasses.replace(PRODUCTION[0], commit=args.baseline),)
    if args.commit_wait:
        production += (dataclasses.replace(PRODUCTION[0], without=("synchronous commit",)),)
    run = Run(sizes=args.sizes[:1] if args.production_only else args.sizes)
    run.groups = [
        (
            f"production path: nginx, redis:// — {PRODUCTION[0].label} against the floors",
            production,
        ),
        (f"redis:// straight to gunicorn — {REDIS[0].label} against the floors", REDIS),
        (f"memory:// — {MEMORY[0].label} against the floors", MEMORY),
    ][: 1 if args.production_only else None]
    with bench_database(args) as (server_url, database_url, key, conn):
        for size in run.sizes:
            log(f"seeding {size:,} pets (COPY)")
            table = seed(conn, size)
            run.pages[size] = table.page
            run.scenario_names = [s.name for s in scenarios(table, args.scenarios)]
            first = size == min(args.sizes)
            for _title, servers in run.groups if first else run.groups[-1:]:
                headline = servers == production or (first and servers == MEMORY)
                rounds = args.rounds if headline else args.second_rounds
                bench_group(args, conn, database_url, key, table, servers, rounds, run)
            if first and not args.production_only:
                where_the_distance_goes(args, conn, database_url, key, table, run)
                if args.configs:
                    serving_configs(args, conn, database_url, key, table, run)
        if args.size_comparison:
            table_sizes(args, conn, server_url, database_url, key, run)
        if not args.production_only:
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
    pictures = []
    if run.groups:
        pictures = [plot_size(run, size, args.output / f"{stem}-{size}.png") for size in run.sizes]
        pictures.insert(0, plot_summary(run, args.output / "summary.png"))
    invocation = (
        f".venv/bin/python -m bench.run --sizes {','.join(str(size) for size in run.sizes)} "
        f"--duration {args.duration} --rounds {args.rounds} --second-rounds {args.second_rounds} "
        f"--config-rounds {args.config_rounds} --warmup {args.warmup} "
        f"--connections {args.connections} --threads {args.threads}"
        + ("" if args.configs else " --no-configs")
        + (f" --baseline {args.baseline}" if args.baseline else "")
        + (" --commit-wait" if args.commit_wait else "")
        + (f" --size-comparison {args.size_comparison}" if args.size_comparison else "")
        + (" --production-only" if args.production_only else "")
        + "".join(f" --scenario {shlex.quote(name)}" for name in args.scenarios or ())
        + (" --configs-only" if args.configs_only else "    # make bench runs the defaults")
    )
    settings = {
        "threads": str(args.threads),
        "connections": str(args.connections),
        "rounds": str(args.rounds),
        "config_rounds": str(args.config_rounds),
        "duration": str(args.duration),
        "warmup": str(args.warmup),
        "invocation": (f"DATABASE_URL={facts['database']} " if facts["database"] else "")
        + invocation,
        "size_service": MEMORY[0].label,
        "size_floor": MEMORY[2].label,
    }
    path = args.output / f"{stem}{'-configs' if args.configs_only else ''}.md"
    previous = previous_report(args.output)
    report = render(run, facts, settings, time.monotonic() - STARTED, pictures, previous)
    path.write_text(report)
    print(f"\n{report}")
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    plots = f", plots beside it ({', '.join(p.name for p in pictures)})" if pictures else ""
    log(f"report written to {shown}{plots}")


if __name__ == "__main__":
    sys.exit(main())
