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
import os
import shlex
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

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
    scenarios,
    seed,
    size_checks,
)
from bench.inprocess import budget
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
from bench.numbers import rotation
from bench.plots import plot_size, plot_summary
from bench.report import Run, previous_report, render
from bench.servers import (
    CONFIGS,
    DISTANCE,
    MEMORY,
    PRODUCTION,
    REDIS,
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


def interrupt(signum: int, frame: FrameType | None) -> None:
    """SIGTERM behaves like Ctrl-C: unwind, stopping every server on the way."""
    raise KeyboardInterrupt


@dataclass(frozen=True)
class Setup:
    """What every step of a run works with: the options, the scratch database (its URL, the
    bench key, an admin connection) and the Run that gathers the measures."""

    options: Options
    database_url: str
    key: str
    conn: Conn
    run: Run


def check_and_warm_up(
    setup: Setup, masters: dict[Server, Running], table: Table
) -> dict[Server, Target]:
    """Compare each server's answers with the first one's, warm it up; wrk's targets."""
    key, run = setup.key, setup.run
    targets: dict[Server, Target] = {}
    reference: Answers = {}
    for server, running in masters.items():
        answers = sample_answers(running.port, key, [*table.sample_paths])
        if reference:
            label = f"{server.label} ({table.size:,} pets)"
            run.notes += compare_answers(reference, answers, label)
        reference = reference or answers
        targets[server] = running.target(key, table)
        warm_up(setup.options, targets[server], setup.conn, table)
    return targets


def warm_up(options: Options, target: Target, conn: Conn, table: Table) -> None:
    """--warmup seconds of the mixed scenario, then the pets it created deleted."""
    warming = Scenario("warm-up", "mixed.lua", "/v1/pets")
    run_wrk(target, warming, options.warmup, options.connections, options.threads)
    forget_new_pets(conn, table)


def interleaved(
    setup: Setup,
    table: Table,
    targets: dict[Server, Target],
    chosen: list[Scenario],
    rounds: int,
    keep: Callable[[Server, Scenario, Measure], None],
) -> None:
    """`rounds` paired rounds: each runs every scenario on every server once, in turn."""
    options, conn = setup.options, setup.conn
    redis_pids = local_redis_pids(options.redis_url)
    for number in range(rounds):
        log(f"{table.size:>9,} pets  round {number + 1} of {rounds}")
        for scenario in chosen:
            for server, target in rotation(list(targets.items()), number):
                backends = pool_backends(conn, target.app_pids())
                its_redis = redis_pids if server.storage == "redis" else None
                measure = options.wrk(target, scenario, backends, its_redis)
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


def bench_group(setup: Setup, table: Table, servers: tuple[Server, ...], rounds: int) -> None:
    """The service and both floors of one group: interleaved rounds of every scenario."""
    options, conn, run = setup.options, setup.conn, setup.run
    redis.Redis.from_url(options.redis_url, socket_timeout=5).flushdb()
    with contextlib.ExitStack() as stack:
        masters = start_servers(
            stack, servers, setup.database_url, options.redis_url, str(table.size), run.commands
        )
        targets = check_and_warm_up(setup, masters, table)

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

        chosen = scenarios(table, options.scenarios)
        interleaved(setup, table, targets, chosen, rounds, keep)
        for scenario in chosen:
            for server in servers:
                kept = run.rounds[(table.size, server.label, scenario.name)]
                say(table, server.label, scenario.name, kept)
        if table.size == max(options.sizes) and servers == MEMORY:
            check_sizes(setup, table, targets)
        for server, running in masters.items():
            run.rss_kib[(table.size, server.label)] = [
                peak_rss_kib(pid) for pid in running.worker_pids()
            ]


def where_the_distance_goes(setup: Setup, table: Table) -> None:
    """The floors, the service without the limiter and the request log, without the limiter, whole."""
    reads = [
        s for s in scenarios(table) if s.name in ("GET /v1/pets?limit=20", "GET /v1/pets/{id}")
    ]
    setup.run.distance_servers = DISTANCE
    setup.run.distance_size = table.size
    side_by_side(setup, table, DISTANCE, reads, setup.options.second_rounds, setup.run.distance)


def serving_configs(setup: Setup, table: Table) -> None:
    """The service on redis:// under each gunicorn configuration: limit=20 and POST, or the
    scenarios --scenario names."""
    names = setup.options.scenarios or ["GET /v1/pets?limit=20", "POST /v1/pets"]
    chosen = scenarios(table, names)
    redis.Redis.from_url(setup.options.redis_url, socket_timeout=5).flushdb()
    side_by_side(setup, table, CONFIGS, chosen, setup.options.config_rounds, setup.run.configs)


def side_by_side(
    setup: Setup,
    table: Table,
    servers: tuple[Server, ...],
    chosen: list[Scenario],
    rounds: int,
    into: dict[tuple[str, str], list[Measure]],
) -> None:
    """Start `servers`, run `rounds` interleaved rounds of `chosen` on them, keep each measure
    in `into` by (scenario, server label), and say how each did."""
    options, run = setup.options, setup.run
    with contextlib.ExitStack() as stack:
        masters = start_servers(
            stack, servers, setup.database_url, options.redis_url, str(table.size), run.commands
        )
        targets = check_and_warm_up(setup, masters, table)

        def keep(server: Server, scenario: Scenario, measure: Measure) -> None:
            into.setdefault((scenario.name, server.label), []).append(measure)

        interleaved(setup, table, targets, chosen, rounds, keep)
    for (name, label), measures in into.items():
        say(table, label, name, measures)


def table_sizes(setup: Setup, server_url: str, larger: int) -> None:
    """The same service on the first size's table and on `larger` pets' (--size-comparison),
    each through its own nginx, in paired rounds of the read scenarios."""
    options, conn, run = setup.options, setup.conn, setup.run
    small = seed(conn, min(options.sizes))
    servers = tuple(dataclasses.replace(PRODUCTION[0], pets=size) for size in (small.size, larger))
    run.size_pair = servers
    redis.Redis.from_url(options.redis_url, socket_timeout=5).flushdb()
    with contextlib.ExitStack() as stack:
        _server_url, large_url, large_key, large_conn = stack.enter_context(
            bench_database(server_url, f"{options.scratch_database}_large")
        )
        log(f"seeding {larger:,} pets (COPY) beside the {small.size:,}")
        large = seed(large_conn, larger)
        sides = {
            servers[0]: (setup.database_url, setup.key, small, conn),
            servers[1]: (large_url, large_key, large, large_conn),
        }
        targets, chosen = {}, {}
        for server, (url, its_key, table, its_conn) in sides.items():
            running = start_servers(
                stack, (server,), url, options.redis_url, str(table.size), run.commands
            )[server]
            targets[server] = running.target(its_key, table)
            warm_up(options, targets[server], its_conn, table)
            # The deep page: the one before the last, at either size.
            near_end = dataclasses.replace(table, cursor=table.max_id - 2 * PAGE_LIMIT)
            chosen[server] = [each for each in scenarios(near_end) if not each.writes]
        names = [each.name for each in chosen[servers[0]]]
        run.scenario_names = list(dict.fromkeys([*run.scenario_names, *names]))
        redis_pids = local_redis_pids(options.redis_url)
        for number in range(options.rounds):
            log(f"table sizes  round {number + 1} of {options.rounds}")
            for index in range(len(chosen[servers[0]])):
                for server in rotation(list(servers), number):
                    scenario = chosen[server][index]
                    backends = pool_backends(sides[server][3], targets[server].app_pids())
                    measure = options.wrk(targets[server], scenario, backends, redis_pids)
                    run.rounds.setdefault((small.size, server.label, scenario.name), []).append(
                        measure
                    )
        for server in servers:
            for scenario in chosen[server]:
                kept = run.rounds[(small.size, server.label, scenario.name)]
                say(small, server.label, scenario.name, kept)


def check_sizes(setup: Setup, table: Table, targets: dict[Server, Target]) -> None:
    """Latency of the first, the deep and a filtered page at one connection: service, raw floor.

    In rounds of one second, each page on each server in turn; each page keeps the median of
    its rounds' medians.
    """
    rounds: dict[tuple[str, str], list[Measure]] = {}
    chosen, conn, run = (MEMORY[0], MEMORY[2]), setup.conn, setup.run
    for _round in range(min(setup.options.rounds, SIZE_ROUNDS)):
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


def option(default: Any, text: str, **argparse_kwargs: Any) -> Any:
    """A field of Options: its default, its --help text and what else argparse needs."""
    return dataclasses.field(default=default, metadata={"help": text, **argparse_kwargs})


@dataclass(frozen=True)
class Options:
    """What a run measures and how: the command line's options, their defaults and help."""

    database_url: str | None = option(
        None,
        "PostgreSQL server to make the scratch database on "
        "(default: $DATABASE_URL, else the embedded one under var/bench-postgres)",
    )
    scratch_database: str = option("petstore_bench", "made afresh for the run, dropped after it")
    redis_url: str = option("redis://127.0.0.1:6379/9", "emptied before use")
    sizes: tuple[int, ...] = option(
        (10_000, 1_000_000),
        "pets in the table, comma-separated (default 10000,1000000); redis:// and the serving "
        "configurations run at the first size only",
        type=lambda text: tuple(sorted(int(each) for each in text.split(","))),
    )
    # Short rounds, many of them: background load comes and goes, and a ratio's median over
    # many short interleaved rounds moves less than over a few long ones in the same time.
    duration: int = option(1, "seconds per round")
    rounds: int = option(8, f"paired rounds per scenario, at least {MIN_ROUNDS}")
    warmup: int = option(2, "seconds of warm-up per server")
    connections: int = option(8, "wrk connections")
    threads: int = option(1, "wrk threads")
    second_rounds: int = option(
        4,
        "rounds of the tables after the headline and memory:// at the first size: redis:// "
        "straight to gunicorn, memory:// at the larger sizes, where the distance goes",
    )
    configs: bool = option(True, "run the serving configurations table through nginx (default: on)")
    baseline: str | None = option(
        None,
        "also serve the service as built at COMMIT (git archive into var/bench-baseline/) in "
        "the production path's rotation, and report the service against it",
        metavar="COMMIT",
    )
    commit_wait: bool = option(
        False,
        "also serve the service with synchronous_commit off in the production path's "
        "rotation: what a commit's wait for its WAL flush costs each scenario",
    )
    cold_keys: bool = option(
        False,
        "also serve the service with every key counted request by request "
        "(PETSTORE_RATELIMIT_HOT_RATE=0: no leases) in the production path's rotation",
    )
    size_comparison: int | None = option(
        None,
        "also serve the production path's service on a second database of PETS pets beside "
        "the first size's, and compare the two in paired rounds of the read scenarios",
        type=int,
        metavar="PETS",
    )
    production_only: bool = option(
        False,
        "only the production path (the headline) at the first size: no other group, "
        "distance, configurations, plans or in-process budget",
    )
    scenarios: tuple[str, ...] = option(
        (),
        "only this scenario (its name as the report gives it; repeat for more; default: all)",
        flag="--scenario",
        action="append",
        metavar="NAME",
    )
    configs_only: bool = option(
        False,
        "only the serving configurations through nginx, at the first size, into "
        "<date>-<host>-configs.md",
    )
    config_rounds: int = option(4, "rounds of the configurations")
    in_process_only: bool = option(
        False, "only the in-process per-request budget table, printed (no wrk, no servers)"
    )
    in_process_requests: int = option(400, "requests per in-process round")
    in_process_rounds: int = option(8, "in-process rounds")
    output: Path = option(ROOT / "bench" / "results", "report directory (default bench/results)")

    def command_line(self) -> str:
        """The command that runs what these options ran, as the report gives it."""
        return (
            f".venv/bin/python -m bench.run --sizes {','.join(map(str, self.run_sizes()))} "
            f"--duration {self.duration} --rounds {self.rounds} "
            f"--second-rounds {self.second_rounds} --config-rounds {self.config_rounds} "
            f"--warmup {self.warmup} --connections {self.connections} --threads {self.threads}"
            + ("" if self.configs else " --no-configs")
            + (f" --baseline {self.baseline}" if self.baseline else "")
            + (" --commit-wait" if self.commit_wait else "")
            + (" --cold-keys" if self.cold_keys else "")
            + (f" --size-comparison {self.size_comparison}" if self.size_comparison else "")
            + (" --production-only" if self.production_only else "")
            + "".join(f" --scenario {shlex.quote(name)}" for name in self.scenarios)
            + (" --configs-only" if self.configs_only else "    # make bench runs the defaults")
        )

    def scratch(self) -> contextlib.AbstractContextManager[tuple[str, str, str, Conn]]:
        """The run's scratch database: (server URL, database URL, key, admin connection)."""
        return bench_database(self.database_url, self.scratch_database)

    def wrk(
        self,
        target: Target,
        scenario: Scenario,
        backends: list[int] | None,
        redis_pids: list[int] | None,
    ) -> Measure:
        """One run of wrk for --duration with --connections and --threads (measure.run_wrk)."""
        return run_wrk(
            target, scenario, self.duration, self.connections, self.threads, backends, redis_pids
        )

    def budget(self, database_url: str, key: str) -> str:
        """The in-process per-request budget table (--in-process-requests, --in-process-rounds)."""
        requests, rounds = self.in_process_requests, self.in_process_rounds
        return budget(self.redis_url, database_url, key, requests, rounds)

    def run_sizes(self) -> list[int]:
        """The table sizes measured: the first alone with --production-only or --configs-only."""
        return list(self.sizes[:1] if self.production_only or self.configs_only else self.sizes)


def parse_args(argv: list[str] | None = None) -> Options:
    """The command line (sys.argv's without `argv`) as Options, each option from its field."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.run", description=(__doc__ or "").splitlines()[0]
    )
    for each in dataclasses.fields(Options):
        kwargs = {"dest": each.name, "default": each.default, **each.metadata}
        flag = kwargs.pop("flag", f"--{each.name.replace('_', '-')}")
        if isinstance(each.default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction if each.default else "store_true"
        elif each.default not in (None, ()):
            kwargs.setdefault("type", type(each.default))
            if "default" not in kwargs["help"]:
                kwargs["help"] += " (default %(default)s)"
        parser.add_argument(flag, **kwargs)
    # argparse appends to --scenario's default: a list of its own, not the tuple.
    parser.set_defaults(database_url=os.environ.get("DATABASE_URL") or None, scenarios=None)
    parsed = vars(parser.parse_args(argv))
    options = Options(**{**parsed, "scenarios": tuple(parsed["scenarios"] or ())})
    counts = (options.duration, options.warmup, options.second_rounds, options.config_rounds)
    if min(counts) < 1:
        parser.error("--duration, --warmup, --second-rounds, --config-rounds: at least 1")
    if options.rounds < MIN_ROUNDS:
        parser.error(
            f"--rounds: at least {MIN_ROUNDS} (paired rounds, see bench/results/README.rst)"
        )
    if min(options.sizes) < 2 * PAGE_LIMIT:
        parser.error(f"--sizes: at least {2 * PAGE_LIMIT} pets")
    return options


def main() -> int:
    """Run the benchmark; write and print the report."""
    options = parse_args()
    signal.signal(signal.SIGTERM, interrupt)
    try:
        if options.in_process_only:
            return in_process_only(options)
        if options.configs_only:
            return configs_only(options)
        return bench(options)
    except KeyboardInterrupt:
        log("interrupted: stopped what the run had started")
        return 130


def in_process_only(options: Options) -> int:
    """Seed the smallest size and print the in-process budget table."""
    with options.scratch() as (_server_url, database_url, key, conn):
        log(f"seeding {min(options.sizes):,} pets (COPY)")
        seed(conn, min(options.sizes))
        table = options.budget(database_url, key)
    print(f"\n{table}\n")
    log("done")
    return 0


def configs_only(options: Options) -> int:
    """Seed the smallest size, measure the serving configurations through nginx, report them."""
    for program in ("wrk", "nginx"):
        ensure_program(program)
    run = Run(sizes=options.run_sizes())
    with options.scratch() as (_server_url, database_url, key, conn):
        log(f"seeding {min(options.sizes):,} pets (COPY)")
        table = seed(conn, min(options.sizes))
        run.pages[table.size] = table.page
        serving_configs(Setup(options, database_url, key, conn, run), table)
        facts = machine_facts(conn, options.database_url)
    note_background_load(run)
    write_report(options, run, facts)
    return 0


def bench(options: Options) -> int:
    """Set up, measure, write the report; stop what was started, however it ends."""
    for program in ("wrk", "nginx"):
        ensure_program(program)
    production = PRODUCTION
    if options.baseline:
        production += (dataclasses.replace(PRODUCTION[0], commit=options.baseline),)
    if options.commit_wait:
        production += (dataclasses.replace(PRODUCTION[0], without=("synchronous commit",)),)
    if options.cold_keys:
        production += (dataclasses.replace(PRODUCTION[0], without=("leases",)),)
    run = Run(sizes=options.run_sizes())
    run.groups = [
        (
            f"production path: nginx, redis:// — {PRODUCTION[0].label} against the floors",
            production,
        ),
        (f"redis:// straight to gunicorn — {REDIS[0].label} against the floors", REDIS),
        (f"memory:// — {MEMORY[0].label} against the floors", MEMORY),
    ][: 1 if options.production_only else None]
    with options.scratch() as (server_url, database_url, key, conn):
        setup = Setup(options, database_url, key, conn, run)
        for size in run.sizes:
            log(f"seeding {size:,} pets (COPY)")
            table = seed(conn, size)
            run.pages[size] = table.page
            run.scenario_names = [s.name for s in scenarios(table, options.scenarios)]
            first = size == min(options.sizes)
            for _title, servers in run.groups if first else run.groups[-1:]:
                headline = servers == production or (first and servers == MEMORY)
                rounds = options.rounds if headline else options.second_rounds
                bench_group(setup, table, servers, rounds)
            if first and not options.production_only:
                where_the_distance_goes(setup, table)
                if options.configs:
                    serving_configs(setup, table)
        if options.size_comparison:
            table_sizes(setup, server_url, options.size_comparison)
        if not options.production_only:
            log(f"EXPLAIN (ANALYZE, BUFFERS) of the list queries at {table.size:,} pets")
            run.plans = explain_list_queries(conn, table)
            seed(conn, min(options.sizes))
            run.budget = options.budget(database_url, key)
        facts = machine_facts(conn, options.database_url)
    if not any("unlike the service" in note or "other bytes" in note for note in run.notes):
        run.notes.insert(
            0,
            "Both floors answered the sampled requests as the service did: status, body bytes, "
            "Link (and the status of a 404).",
        )
    note_background_load(run)
    write_report(options, run, facts)
    return 0


def write_report(options: Options, run: Run, facts: dict[str, str]) -> None:
    """The Markdown report and its plots, beside each other in --output."""
    options.output.mkdir(parents=True, exist_ok=True)
    stem = f"{time.strftime('%Y-%m-%d')}-{socket.gethostname()}"
    pictures = []
    if run.groups:
        pictures = [
            plot_size(run, size, options.output / f"{stem}-{size}.png") for size in run.sizes
        ]
        pictures.insert(0, plot_summary(run, options.output / "summary.png"))
    settings = {
        "threads": str(options.threads),
        "connections": str(options.connections),
        "rounds": str(options.rounds),
        "config_rounds": str(options.config_rounds),
        "duration": str(options.duration),
        "warmup": str(options.warmup),
        "invocation": (f"DATABASE_URL={facts['database']} " if facts["database"] else "")
        + options.command_line(),
        "size_service": MEMORY[0].label,
        "size_floor": MEMORY[2].label,
    }
    path = options.output / f"{stem}{'-configs' if options.configs_only else ''}.md"
    previous = previous_report(options.output)
    report = render(run, facts, settings, time.monotonic() - STARTED, pictures, previous)
    path.write_text(report)
    print(f"\n{report}")
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    plots = f", plots beside it ({', '.join(p.name for p in pictures)})" if pictures else ""
    log(f"report written to {shown}{plots}")


if __name__ == "__main__":
    sys.exit(main())
