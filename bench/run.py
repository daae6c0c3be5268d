"""`make bench`: the service against the floor (bench/floor.py) under wrk, on N pets; a Markdown report.

For each table size: seed the pets with COPY, then for each server under test (gunicorn with
deploy/gunicorn.conf.py on a free loopback port) check its answers, warm it up and run every wrk
scenario of bench/wrk/. At the first size, also the service with flask-limiter and the request log
switched off (ABLATION_APP), to show where the distance to the floor goes. The report goes
to stdout and to bench/results/<date>-<host>.md.

    .venv/bin/python bench/run.py [--database-url URL] [--sizes 10000,1000000] [--duration 5]

Without --database-url (or DATABASE_URL) it starts the embedded PostgreSQL under var/bench-postgres
(and stops it at the end). Either way it works in a scratch database `petstore_bench`, dropped at
the end. Server logs go to var/bench-logs/.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import platform
import resource
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import psycopg
import redis
from flask import Flask
from psycopg import conninfo, sql
from psycopg.rows import dict_row

from petstore import auth, config, create_app, db, storages
from petstore.queries import pets

ROOT = Path(__file__).resolve().parent.parent
WRK_DIR = ROOT / "bench" / "wrk"
LOG_DIR = ROOT / "var" / "bench-logs"
EMBEDDED_DIR = ROOT / "var" / "bench-postgres"
GUNICORN_CONFIG = "deploy/gunicorn.conf.py"
BENCH_DB = "petstore_bench"
THREADS = 4  # gunicorn threads per worker, in every server under test
PAGE = 1000  # the deep page of the paging scenario and of the size check
PAGE_LIMIT = 20
# Seeded statuses, in turn: 40% available, 20% pending, 20% sold, 20% not stated (NULL).
STATUSES = ("available", "pending", "available", "sold", None)
READY_TIMEOUT = 30.0
STOP_TIMEOUT = 30.0
LIMITER_ROUNDS = 5
DISTANCE_ROUNDS = 3
# The service with flask-limiter switched off; gunicorn calls the factory (literal arguments only).
ABLATION_APP = "petstore:create_app({'RATELIMIT_ENABLED': False})"
STARTED = time.monotonic()

Conn = psycopg.Connection[dict[str, Any]]
Answers = dict[str, tuple[int, Any, str | None, bytes]]


@dataclass(frozen=True)
class Scenario:
    """One wrk run: a script of bench/wrk/ and the path of its URL."""

    name: str
    script: str
    path: str
    writes: bool = False


@dataclass(frozen=True)
class Server:
    """A server under test: the service or the floor, the comparison it is in, its worker count.

    `without` switches parts of the service off, to show what they cost: "limiter" (gunicorn
    serves ABLATION_APP) and "request log" (PETSTORE_LOG_LEVEL=warning).
    """

    app: str  # "service" or "floor"
    storage: str  # "memory" or "redis"
    workers: int
    without: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """How the report names it."""
        storage = f" {self.storage}://" if self.app == "service" else ""
        parts = f" without the {' and the '.join(self.without)}" if self.without else ""
        return f"{self.app}{storage} {self.workers}×{THREADS}{parts}"


SERVERS = (
    Server("service", "memory", 1),
    Server("floor", "memory", 1),
    Server("service", "redis", 2),
    Server("floor", "redis", 2),
)
# Where the distance between the service and the floor goes: parts of the service switched off.
DISTANCE = (
    Server("floor", "memory", 1),
    Server("service", "memory", 1, without=("limiter", "request log")),
    Server("service", "memory", 1, without=("limiter",)),
    Server("service", "memory", 1),
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


@dataclass(frozen=True)
class Target:
    """A running server as wrk drives it."""

    port: int
    app_pids: list[int]
    wrk_env: dict[str, str]


@dataclass
class Measure:
    """What one wrk run measured, and the CPU spent meanwhile by the app, PostgreSQL, wrk, others."""

    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    errors: int
    app_cpu: float
    pg_cpu: float | None
    wrk_cpu: float
    other_cpu: float

    @property
    def rps(self) -> float:
        """Requests per second."""
        return self.requests / self.seconds

    def per_request_us(self, cpu_seconds: float | None) -> float | None:
        """CPU seconds spread over the requests, in microseconds each."""
        if cpu_seconds is None or not self.requests:
            return None
        return cpu_seconds / self.requests * 1e6


@dataclass
class Run:
    """Everything one benchmark run gathers for the report."""

    measures: dict[tuple[int, str, str], Measure] = field(default_factory=dict)
    single: dict[tuple[str, str], Measure] = field(default_factory=dict)
    rss_kib: dict[tuple[int, str], list[int]] = field(default_factory=dict)
    plans: list[tuple[str, str, str]] = field(default_factory=list)
    limiter_us: dict[str, tuple[float, float]] = field(default_factory=dict)
    distance: dict[tuple[str, str], Measure] = field(default_factory=dict)
    distance_size: int = 0
    notes: list[str] = field(default_factory=list)
    commands: dict[str, str] = field(default_factory=dict)
    pages: dict[int, int] = field(default_factory=dict)


def scenarios(table: Table) -> list[Scenario]:
    """The measured scenarios."""
    return [
        Scenario("GET /v1/pets?limit=20", "get.lua", "/v1/pets?limit=20"),
        Scenario(
            "GET /v1/pets?limit=100&status=available",
            "get.lua",
            "/v1/pets?limit=100&status=available",
        ),
        Scenario(f"page {table.page:,}, then rel=next", "follow.lua", table.deep_path),
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


def log(message: str) -> None:
    """Progress on stdout, with the seconds since start."""
    print(f"[{time.monotonic() - STARTED:5.0f}s] {message}", flush=True)


def interrupt(signum: int, frame: FrameType | None) -> None:
    """SIGTERM behaves like Ctrl-C: unwind, stopping every server on the way."""
    raise KeyboardInterrupt


# --- wrk ---------------------------------------------------------------------------------------


def ensure_wrk() -> None:
    """Make sure wrk is there: installed from Debian's packages when missing and we are root."""
    if shutil.which("wrk"):
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        sys.exit("wrk is missing: install it (Debian: sudo apt-get install -y wrk) and run again")
    log("wrk is missing: apt-get update && apt-get install -y wrk")
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "wrk"]):
        subprocess.run(command, check=True, timeout=600, stdout=subprocess.DEVNULL)
    if not shutil.which("wrk"):
        sys.exit("apt-get installed no wrk")


def run_wrk(
    args: argparse.Namespace,
    target: Target,
    scenario: Scenario,
    duration: int,
    connections: int,
    pg_pids: list[int] | None = None,
) -> Measure:
    """Drive the server with wrk for `duration` seconds; what wrk measured and who spent CPU."""
    command = [
        "wrk",
        f"-t{min(args.threads, connections)}",
        f"-c{connections}",
        f"-d{duration}s",
        "--latency",
        "--timeout",
        "5s",
        "-s",
        scenario.script,
        f"http://127.0.0.1:{target.port}{scenario.path}",
    ]
    app_before = cpu_seconds(target.app_pids)
    pg_before = cpu_seconds(pg_pids or [])
    busy_before = machine_busy_seconds()
    wrk_before = children_cpu_seconds()
    with subprocess.Popen(
        command,
        cwd=WRK_DIR,
        env=target.wrk_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as wrk:
        try:
            stdout, stderr = wrk.communicate(timeout=duration + 60)
        except BaseException:  # a timeout, or Ctrl-C: leave no wrk behind, not even a zombie
            wrk.kill()
            wrk.wait()
            raise
    wrk_cpu = children_cpu_seconds() - wrk_before
    busy = machine_busy_seconds() - busy_before
    app_cpu = cpu_seconds(target.app_pids) - app_before
    pg_cpu = cpu_seconds(pg_pids or []) - pg_before
    summary = [line[6:] for line in stdout.splitlines() if line.startswith("BENCH ")]
    if wrk.returncode != 0 or not summary:
        raise RuntimeError(f"wrk failed ({wrk.returncode}):\n{stdout}\n{stderr}")
    numbers = json.loads(summary[0])
    return Measure(
        requests=numbers["requests"],
        seconds=numbers["duration_us"] / 1e6,
        p50_ms=numbers["p50_us"] / 1e3,
        p99_ms=numbers["p99_us"] / 1e3,
        errors=sum(numbers[kind] for kind in ("connect", "read", "write", "status", "timeout")),
        app_cpu=app_cpu,
        pg_cpu=pg_cpu if pg_pids else None,
        wrk_cpu=wrk_cpu,
        other_cpu=max(0.0, busy - app_cpu - pg_cpu - wrk_cpu),
    )


# --- processes ---------------------------------------------------------------------------------


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds spent so far by these processes (gone ones count 0)."""
    ticks = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine has spent not idle since boot."""
    fields = [int(each) for each in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    """CPU seconds of our finished children (wrk, once it has been waited for)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def children_of(pid: int) -> list[int]:
    """Pids of the live children of `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
    return sorted(found)


def peak_rss_kib(pid: int) -> int:
    """VmHWM of a process: its peak resident set size, in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def free_port() -> int:
    """A loopback TCP port nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def get(port: int, path: str, key: str | None = None) -> tuple[int, dict[str, str], bytes]:
    """GET a path of a server: status, headers, body."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request("GET", path, headers={"Authorization": f"Bearer {key}"} if key else {})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


@dataclass
class Gunicorn:
    """A gunicorn master running one server under test, in its own process group."""

    process: subprocess.Popen[bytes]
    port: int
    workers: int
    log_path: Path

    def wait_ready(self) -> None:
        """Wait until every worker is up and /healthz answers, at most READY_TIMEOUT."""
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"gunicorn exited ({self.process.returncode}):\n{self.tail()}")
            with contextlib.suppress(OSError, http.client.HTTPException):
                if get(self.port, "/healthz")[0] == 200 and len(self.worker_pids()) == self.workers:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"gunicorn not ready within {READY_TIMEOUT:.0f} s:\n{self.tail()}")

    def worker_pids(self) -> list[int]:
        """The worker processes of this master."""
        return children_of(self.process.pid)

    def stop(self) -> None:
        """SIGTERM (graceful) to the group, then SIGKILL if anything of it is still there."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                log(f"gunicorn {self.process.pid} did not stop in {STOP_TIMEOUT:.0f} s: SIGKILL")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(5)

    def tail(self, lines: int = 30) -> str:
        """The end of the server's log."""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def server_env(server: Server, database_url: str, redis_url: str, port: int) -> dict[str, str]:
    """The server's environment: ours without any service setting, plus the ones under test."""
    ours = ("PETSTORE_", "RATELIMIT_", "GUNICORN_")
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(ours) and name not in ("WEB_CONCURRENCY", "BIND", "DATABASE_URL")
    }
    env.update(
        DATABASE_URL=database_url,
        BIND=f"127.0.0.1:{port}",
        RATELIMIT_STORAGE_URI="memory://" if server.storage == "memory" else redis_url,
        WEB_CONCURRENCY=str(server.workers),
        PETSTORE_THREADS=str(THREADS),
    )
    if "request log" in server.without:
        env["PETSTORE_LOG_LEVEL"] = "warning"  # the request log is written at info
    return env


def server_command(server: Server) -> list[str]:
    """The gunicorn command line of a server (its settings come from the environment)."""
    if server.app == "floor":
        app = ["--pythonpath", "bench", "floor:app"]
    elif "limiter" in server.without:
        app = [ABLATION_APP]
    else:
        app = ["wsgi:app"]
    return [sys.executable, "-m", "gunicorn", "-c", GUNICORN_CONFIG, *app]


def shown_command(server: Server, env: dict[str, str]) -> str:
    """The server's command line for the report: no paths, no secrets."""
    settings = (
        "RATELIMIT_STORAGE_URI",
        "WEB_CONCURRENCY",
        "PETSTORE_THREADS",
        "PETSTORE_LOG_LEVEL",
    )
    command = [".venv/bin/python", *server_command(server)[1:]]
    return (
        "DATABASE_URL=<bench database> BIND=127.0.0.1:<port> "
        + " ".join(f"{name}={env[name]}" for name in settings if name in env)
        + f" {shlex.join(command)}"
    )


@contextlib.contextmanager
def gunicorn(server: Server, env: dict[str, str], port: int, name: str) -> Iterator[Gunicorn]:
    """Run the server until the block ends, however it ends."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log_path = LOG_DIR / f"{name}.log"
    with log_path.open("wb") as output:
        process = subprocess.Popen(
            server_command(server),
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group: Ctrl-C reaches us, and we stop it in order
        )
    running = Gunicorn(process, port, server.workers, log_path)
    try:
        yield running
    finally:
        running.stop()


# --- database ----------------------------------------------------------------------------------


def redacted(url: str) -> str:
    """A libpq URL or conninfo as a URL without its password, for the report."""
    params = conninfo.conninfo_to_dict(url)
    user = f"{params['user']}@" if params.get("user") else ""
    port = f":{params['port']}" if params.get("port") else ""
    return f"postgresql://{user}{params.get('host', '')}{port}/{params.get('dbname', '')}"


def create_database(server_url: str) -> str:
    """Create the scratch database afresh on the server; return its conninfo."""
    drop_database(server_url)
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(sql.SQL("create database {}").format(sql.Identifier(BENCH_DB)))
    return conninfo.make_conninfo(server_url, dbname=BENCH_DB)


def drop_database(server_url: str) -> None:
    """Drop the scratch database if it is there."""
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(BENCH_DB))
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


# --- the run -----------------------------------------------------------------------------------


def sample_answers(port: int, key: str, table: Table) -> Answers:
    """Status, parsed JSON, Link header and raw body of a few requests."""
    paths = [
        "/v1/pets?limit=20",
        "/v1/pets?limit=100&status=available",
        table.deep_path,
        f"/v1/pets/{table.min_id}",
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
        if (status, body, link) != want[:3]:
            run.notes.append(f"{label} answers `{path}` unlike the service: {status} {raw[:100]!r}")
        elif raw != want[3]:
            run.notes.append(f"{label}: the same JSON as the service for `{path}`, other bytes")


def record(run: Run, table: Table, server: Server, scenario: Scenario, measure: Measure) -> None:
    """Keep one measure, say it, and note its errors."""
    run.measures[(table.size, server.label, scenario.name)] = measure
    errors = f"  {measure.errors} errors" if measure.errors else ""
    log(
        f"{table.size:>9,} pets  {server.label:<22} {scenario.name:<40} "
        f"{measure.rps:>6,.0f} req/s  p50 {measure.p50_ms:6.2f} ms  "
        f"p99 {measure.p99_ms:6.2f} ms{errors}"
    )
    if measure.errors:
        run.notes.append(
            f"{server.label}, {table.size:,} pets, {scenario.name}: {measure.errors} errors"
        )


def bench_size(
    args: argparse.Namespace, conn: Conn, database_url: str, key: str, table: Table, run: Run
) -> None:
    """Start every server, check and warm each up, then run each scenario on each in turn.

    Running the servers of a comparison one right after the other, scenario by scenario, lets
    both sides of a ratio see the same background load.
    """
    redis.Redis.from_url(args.redis_url, socket_timeout=5).flushdb()
    with contextlib.ExitStack() as stack:
        masters = start_servers(args, stack, SERVERS, database_url, table, run)
        targets = check_and_warm_up(args, conn, masters, key, table, run)
        for scenario in scenarios(table):
            for server, target in targets.items():
                backends = pool_backends(conn)
                measure = run_wrk(args, target, scenario, args.duration, args.connections, backends)
                record(run, table, server, scenario, measure)
                if scenario.writes:
                    forget_new_pets(conn, table)
        if table.size == max(args.sizes):
            check_sizes(args, conn, table, targets, run)
        for server, running in masters.items():
            run.rss_kib[(table.size, server.label)] = [
                peak_rss_kib(pid) for pid in running.worker_pids()
            ]


def start_servers(
    args: argparse.Namespace,
    stack: contextlib.ExitStack,
    servers: tuple[Server, ...],
    database_url: str,
    table: Table,
    run: Run,
) -> dict[Server, Gunicorn]:
    """Start each server on a free port, stopped when `stack` closes; note its command."""
    masters: dict[Server, Gunicorn] = {}
    for server in servers:
        port = free_port()
        env = server_env(server, database_url, args.redis_url, port)
        run.commands.setdefault(server.label, shown_command(server, env))
        without = "".join(f"-without-{part.replace(' ', '-')}" for part in server.without)
        name = f"{table.size}-{server.app}-{server.storage}-{server.workers}w{without}"
        masters[server] = stack.enter_context(gunicorn(server, env, port, name))
    return masters


def check_and_warm_up(
    args: argparse.Namespace,
    conn: Conn,
    masters: dict[Server, Gunicorn],
    key: str,
    table: Table,
    run: Run,
) -> dict[Server, Target]:
    """Wait for each server, compare its answers with the first one's, warm it up; wrk's targets."""
    wrk_env = {
        **os.environ,
        "BENCH_KEY": key,
        "BENCH_MIN_ID": str(table.min_id),
        "BENCH_MAX_ID": str(table.max_id),
    }
    targets: dict[Server, Target] = {}
    reference: Answers = {}
    for server, running in masters.items():
        running.wait_ready()
        answers = sample_answers(running.port, key, table)
        if reference:
            compare_answers(reference, answers, f"{server.label} ({table.size:,} pets)", run)
        reference = reference or answers
        targets[server] = Target(running.port, running.worker_pids(), wrk_env)
        warm_up = Scenario("warm-up", "mixed.lua", "/v1/pets")
        run_wrk(args, targets[server], warm_up, args.warmup, args.connections)
        forget_new_pets(conn, table)
    return targets


def where_the_distance_goes(
    args: argparse.Namespace, conn: Conn, database_url: str, key: str, table: Table, run: Run
) -> None:
    """The floor, the service without the limiter and the request log, without the limiter, whole.

    Two read scenarios, in DISTANCE_ROUNDS interleaved rounds of --duration seconds per server,
    so that each server sees the same background load; the rounds are added up.
    """
    reads = [
        s for s in scenarios(table) if s.name in ("GET /v1/pets?limit=20", "GET /v1/pets/{id}")
    ]
    rounds: dict[tuple[str, str], list[Measure]] = {}
    with contextlib.ExitStack() as stack:
        masters = start_servers(args, stack, DISTANCE, database_url, table, run)
        targets = check_and_warm_up(args, conn, masters, key, table, run)
        for _round in range(DISTANCE_ROUNDS):
            for scenario in reads:
                for server, target in targets.items():
                    backends = pool_backends(conn)
                    measure = run_wrk(
                        args, target, scenario, args.duration, args.connections, backends
                    )
                    rounds.setdefault((scenario.name, server.label), []).append(measure)
    run.distance_size = table.size
    for (name, label), measures in rounds.items():
        run.distance[(name, label)] = whole = combined(measures)
        log(f"{table.size:>9,} pets  {label:<48} {name:<24} {whole.rps:>6,.0f} req/s")


def check_sizes(
    args: argparse.Namespace, conn: Conn, table: Table, targets: dict[Server, Target], run: Run
) -> None:
    """Latency of the first, the deep and a filtered page at one connection, on the 1-worker pair.

    In rounds of one second, each page on each server in turn, so that background load falls on
    all of them alike; each page keeps the median of its rounds' medians.
    """
    rounds: dict[tuple[str, str], list[Measure]] = {}
    for _round in range(args.duration):
        for check in size_checks(table):
            for server in (server for server in SERVERS if server.workers == 1):
                measure = run_wrk(args, targets[server], check, 1, 1, pool_backends(conn))
                rounds.setdefault((server.label, check.name), []).append(measure)
    for (label, name), measures in rounds.items():
        run.single[(label, name)] = combined(measures)
        log(
            f"{table.size:>9,} pets  {label:<22} 1 connection, {name:<32} "
            f"p50 {run.single[(label, name)].p50_ms:6.2f} ms (median of {len(measures)} rounds)"
        )


def combined(measures: list[Measure]) -> Measure:
    """Several runs as one: counts and CPU summed, latencies the median of the runs'."""
    return Measure(
        requests=sum(m.requests for m in measures),
        seconds=sum(m.seconds for m in measures),
        p50_ms=statistics.median(m.p50_ms for m in measures),
        p99_ms=statistics.median(m.p99_ms for m in measures),
        errors=sum(m.errors for m in measures),
        app_cpu=sum(m.app_cpu for m in measures),
        pg_cpu=None
        if any(m.pg_cpu is None for m in measures)
        else sum(m.pg_cpu or 0 for m in measures),
        wrk_cpu=sum(m.wrk_cpu for m in measures),
        other_cpu=sum(m.other_cpu for m in measures),
    )


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


def measure_limiter(args: argparse.Namespace, database_url: str, key: str, run: Run) -> None:
    """The limiter's cost per request in-process, wall and CPU.

    Apps side by side (limiter off, memory://, redis://, and the same two on the `limits`
    library's own storages instead of petstore.storages, to show what those gain) answer
    `GET /v1/pets?limit=1` through Flask's test client, in interleaved rounds; each keeps the
    median of its rounds.
    """
    base = config.from_environ({"DATABASE_URL": database_url})
    redis.Redis.from_url(args.redis_url, socket_timeout=5).flushdb()
    settings: dict[str, tuple[dict[str, Any], bool]] = {
        "limiter off": ({"RATELIMIT_ENABLED": False}, True),
        "memory://": ({"RATELIMIT_STORAGE_URI": "memory://"}, True),
        "redis://": ({"RATELIMIT_STORAGE_URI": args.redis_url}, True),
        "memory://, limits' MemoryStorage": ({"RATELIMIT_STORAGE_URI": "memory://"}, False),
        "redis://, limits' RedisStorage": ({"RATELIMIT_STORAGE_URI": args.redis_url}, False),
    }
    apps = {
        name: app_with_storages({**base, **extra}, ours) for name, (extra, ours) in settings.items()
    }
    headers = {"Authorization": f"Bearer {key}"}
    timings: dict[str, list[tuple[float, float]]] = {name: [] for name in apps}
    try:
        for round_number in range(LIMITER_ROUNDS + 1):
            for name, app in apps.items():
                client = app.test_client()
                wall, cpu = time.perf_counter(), time.process_time()
                for _ in range(args.limiter_requests):
                    response = client.get("/v1/pets?limit=1", headers=headers)
                    assert response.status_code == 200, response.get_data(as_text=True)
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                if round_number:  # the first round warms up: pool, prepared statements
                    timings[name].append((wall, cpu))
    finally:
        for app in apps.values():
            app.extensions["petstore.pool"].close()
    for name, rounds in timings.items():
        wall_us = statistics.median(w for w, _c in rounds) / args.limiter_requests * 1e6
        cpu_us = statistics.median(c for _w, c in rounds) / args.limiter_requests * 1e6
        run.limiter_us[name] = (wall_us, cpu_us)
        log(f"in-process GET /v1/pets?limit=1, {name}: {wall_us:,.0f} µs, CPU {cpu_us:,.0f} µs")


def app_with_storages(settings: dict[str, Any], ours: bool) -> Flask:
    """create_app(settings), with petstore.storages or with the `limits` library's own storages."""
    if ours:
        return create_app(settings)
    chosen = storages.storage_uri
    storages.storage_uri = lambda configured: configured
    try:
        return create_app(settings)
    finally:
        storages.storage_uri = chosen


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
        "--redis-url", default="redis://127.0.0.1:6379/9", help="emptied before use"
    )
    parser.add_argument(
        "--sizes",
        default=[10_000, 1_000_000],
        type=lambda text: sorted(int(each) for each in text.split(",")),
        help="pets in the table, comma-separated (default 10000,1000000)",
    )
    parser.add_argument("--duration", type=int, default=5, help="seconds per scenario (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="seconds of warm-up per server")
    parser.add_argument("--connections", type=int, default=8, help="wrk connections (default 8)")
    parser.add_argument("--threads", type=int, default=1, help="wrk threads (default 1)")
    parser.add_argument(
        "--limiter-requests", type=int, default=1000, help="requests per in-process round"
    )
    parser.add_argument(
        "--output", type=Path, default=ROOT / "bench" / "results", help="report directory"
    )
    args = parser.parse_args()
    if args.duration < 1 or args.warmup < 1:
        parser.error("--duration and --warmup: whole seconds, at least 1")
    if min(args.sizes) < 2 * PAGE_LIMIT:
        parser.error(f"--sizes: at least {2 * PAGE_LIMIT} pets")
    return args


def main() -> int:
    """Run the benchmark; write and print the report."""
    args = parse_args()
    signal.signal(signal.SIGTERM, interrupt)
    try:
        return bench(args)
    except KeyboardInterrupt:
        log("interrupted: stopped what the run had started")
        return 130


def bench(args: argparse.Namespace) -> int:
    """Set up, measure, write the report; stop what was started, however it ends."""
    ensure_wrk()
    run = Run()
    with contextlib.ExitStack() as cleanup:
        server_url = args.database_url
        if server_url is None:
            from petstore import embedded

            cleanup.callback(embedded.stop, EMBEDDED_DIR)
            log(f"starting the embedded PostgreSQL in var/{EMBEDDED_DIR.name}")
            server_url = embedded.ensure_running(EMBEDDED_DIR)
        database_url = create_database(server_url)
        cleanup.callback(drop_database, server_url)
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
        for size in args.sizes:
            log(f"seeding {size:,} pets (COPY)")
            table = seed(conn, size)
            run.pages[size] = table.page
            bench_size(args, conn, database_url, key, table, run)
            if size == min(args.sizes):
                where_the_distance_goes(args, conn, database_url, key, table, run)
        log(f"EXPLAIN (ANALYZE, BUFFERS) of the list queries at {table.size:,} pets")
        run.plans = explain_list_queries(conn, table)
        measure_limiter(args, database_url, key, run)
        facts = machine_facts(conn, args.database_url)
    if not any("unlike the service" in note or "other bytes" in note for note in run.notes):
        run.notes.insert(
            0,
            "The floor answered the sampled requests as the service did: status, body bytes, Link.",
        )
    note_background_load(run)
    report = render(args, run, facts, time.monotonic() - STARTED)
    args.output.mkdir(parents=True, exist_ok=True)
    path = args.output / f"{time.strftime('%Y-%m-%d')}-{socket.gethostname()}.md"
    path.write_text(report)
    print(f"\n{report}")
    print(f"For README.rst (Performance):\n\n{textwrap.indent(readme_table(run), '    ')}\n")
    log(f"report written to {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return 0


# --- the report --------------------------------------------------------------------------------


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

    dirty = output("git", "status", "--porcelain", "petstore", "sql", "wsgi.py", "deploy")
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
    busy = [m.other_cpu / m.seconds for m in run.measures.values() if m.seconds]
    noisy = [share for share in busy if share > 0.25]
    if noisy:
        run.notes.append(
            f"Other processes on the machine used more than a quarter of a core during "
            f"{len(noisy)} of {len(busy)} measures (up to {max(noisy):.2f} cores): those numbers "
            "are noisy; the CPU per request (from /proc) is steadier than requests/s."
        )


def fmt(value: float | None, digits: int = 0) -> str:
    """A number for a table cell; n/a for None."""
    return "n/a" if value is None else f"{value:,.{digits}f}"


def paired(run: Run, storage: str, workers: int) -> Iterator[tuple[int, str, Measure, Measure]]:
    """(pets, scenario, service's measure, floor's measure) of each scenario both servers ran."""
    service = Server("service", storage, workers).label
    floor = Server("floor", storage, workers).label
    for (size, label, name), ours in run.measures.items():
        base = run.measures.get((size, floor, name))
        if label == service and base is not None:
            yield size, name, ours, base


def comparison(run: Run, storage: str, workers: int) -> list[str]:
    """The table of the service against the floor for one storage."""
    lines = [
        "| pets | scenario | service req/s | p50 ms | p99 ms "
        "| floor req/s | p50 ms | p99 ms | service/floor |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for size, name, ours, base in paired(run, storage, workers):
        lines.append(
            f"| {size:,} | {name} | {fmt(ours.rps)} | {fmt(ours.p50_ms, 2)} | "
            f"{fmt(ours.p99_ms, 2)} | {fmt(base.rps)} | {fmt(base.p50_ms, 2)} | "
            f"{fmt(base.p99_ms, 2)} | **{fmt(ours.rps / base.rps, 2)}** |"
        )
    return lines


def cpu_table(run: Run) -> list[str]:
    """CPU per request of the memory:// pair, and how busy wrk and everything else were."""
    lines = [
        "| pets | scenario | service app µs | service PostgreSQL µs | floor app µs "
        "| floor PostgreSQL µs | wrk (cores) | other processes (cores) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for size, name, ours, base in paired(run, "memory", 1):
        wrk = max(ours.wrk_cpu / ours.seconds, base.wrk_cpu / base.seconds)
        other = max(ours.other_cpu / ours.seconds, base.other_cpu / base.seconds)
        lines.append(
            f"| {size:,} | {name} | {fmt(ours.per_request_us(ours.app_cpu))} | "
            f"{fmt(ours.per_request_us(ours.pg_cpu))} | {fmt(base.per_request_us(base.app_cpu))} | "
            f"{fmt(base.per_request_us(base.pg_cpu))} | {wrk:.2f} | {other:.2f} |"
        )
    return lines


def distance_table(run: Run) -> list[str]:
    """Each step from the floor to the whole service: requests/s, against the floor, CPU."""
    floor = DISTANCE[0].label
    lines = [
        "| scenario | server | req/s | × floor | app CPU µs/request | PostgreSQL µs/request |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for (name, label), measure in run.distance.items():
        base = run.distance.get((name, floor))
        ratio = measure.rps / base.rps if base else None
        lines.append(
            f"| {name} | {label} | {fmt(measure.rps)} | **{fmt(ratio, 2)}** | "
            f"{fmt(measure.per_request_us(measure.app_cpu))} | "
            f"{fmt(measure.per_request_us(measure.pg_cpu))} |"
        )
    return lines


def size_table(run: Run) -> list[str]:
    """The deep and the filtered page against the first: median latency, PostgreSQL CPU."""
    service, floor = (Server("service", "memory", 1).label, Server("floor", "memory", 1).label)
    lines = [
        "| page | service p50 ms | × first page | floor p50 ms | × first page "
        "| PostgreSQL CPU µs/request | × first page |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    names = list(dict.fromkeys(name for (_label, name) in run.single))

    def cells(label: str, name: str, value: Callable[[Measure], float | None], digits: int) -> str:
        this, first = run.single.get((label, name)), run.single.get((label, names[0]))
        mine = value(this) if this else None
        base = value(first) if first else None
        ratio = mine / base if mine is not None and base else None
        return f"{fmt(mine, digits)} | {fmt(ratio, 2)}"

    for name in names:
        lines.append(
            f"| {name} | {cells(service, name, lambda m: m.p50_ms, 2)} "
            f"| {cells(floor, name, lambda m: m.p50_ms, 2)} "
            f"| {cells(floor, name, lambda m: m.per_request_us(m.pg_cpu), 0)} |"
        )
    return lines


def readme_table(run: Run) -> str:
    """Requests/s of service and floor, both storages, as reStructuredText for README.rst."""
    memory = (Server("service", "memory", 1), Server("floor", "memory", 1))
    shared = (Server("service", "redis", 2), Server("floor", "redis", 2))
    rows = [
        [
            "pets",
            "scenario (requests/s)",
            "memory://",
            "floor",
            "ratio",
            "redis://",
            "floor",
            "ratio",
        ],
        ["", "", memory[0].label[-3:], memory[1].label[-3:], ""]
        + [shared[0].label[-3:], shared[1].label[-3:], ""],
    ]
    for size, label, name in run.measures:
        if label != memory[0].label:
            continue
        row = [f"{size:,}", name]
        for service, floor in (memory, shared):
            ours = run.measures.get((size, service.label, name))
            base = run.measures.get((size, floor.label, name))
            ratio = ours.rps / base.rps if ours and base else None
            row += [fmt(ours.rps if ours else None), fmt(base.rps if base else None)]
            row.append(fmt(ratio, 2))
        rows.append(row)
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    border = "  ".join("=" * width for width in widths)
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    return "\n".join([border, *lines[:2], border, *lines[2:], border])


def render(args: argparse.Namespace, run: Run, facts: dict[str, str], wall: float) -> str:
    """The Markdown report."""
    largest = max(args.sizes)
    off_wall, off_cpu = run.limiter_us.get("limiter off", (0.0, 0.0))
    invocation = (
        f".venv/bin/python bench/run.py --sizes {','.join(str(size) for size in args.sizes)} "
        f"--duration {args.duration} --warmup {args.warmup} "
        f"--connections {args.connections} --threads {args.threads}"
    )
    source = f"DATABASE_URL={facts['database']} " if facts["database"] else ""
    out = [
        "# Benchmark: the service against the floor",
        "",
        f"{time.strftime('%Y-%m-%d')}, commit {facts['commit']}. **Numbers from one run on one "
        f"machine** ({facts['cpu']}, {facts['cores']} cores, {facts['memory']}; "
        f"{facts['postgres']}, {facts['python']}, {facts['wrk']}); wrk, PostgreSQL, Redis and "
        f"gunicorn share these cores. The run took {wall / 60:.1f} min.",
        "",
        f"Load: wrk with {args.threads} thread(s) and {args.connections} connections, "
        f"{args.duration} s per scenario, after a {args.warmup} s mixed warm-up of each server. "
        f"Every server is gunicorn with `{GUNICORN_CONFIG}` ({THREADS} threads per worker, pool "
        "sized to the threads). The floor, `bench/floor.py`, does only the essential work: the "
        "bearer token, the same key query, the same SQL (the functions of petstore.queries), the "
        "same JSON and headers; no Flask, marshmallow, limiter or request log. Its answers are "
        "compared with the service's first. The servers of a size run side by side, idle but "
        "for the one under load, and each scenario runs on each in turn, so that both sides of "
        "a ratio see about the same background load. Pets that a run creates are deleted after "
        "it. Deep page: "
        + ", ".join(f"page {page:,} at {size:,} pets" for size, page in run.pages.items())
        + ", then `Link: rel=next`.",
        "",
        f"## memory:// — {Server('service', 'memory', 1).label} against the floor",
        "",
        *comparison(run, "memory", 1),
        "",
        f"## redis:// — {Server('service', 'redis', 2).label} against the floor",
        "",
        *comparison(run, "redis", 2),
        "",
        f"## Where the distance goes ({run.distance_size:,} pets, memory://, 1 worker)",
        "",
        "The service with parts switched off, beside the floor and the whole service: "
        f"`{ABLATION_APP}` is the service with flask-limiter disabled, and "
        "`PETSTORE_LOG_LEVEL=warning` drops the request log. "
        f"{DISTANCE_ROUNDS} interleaved rounds of {args.duration} s per server and scenario, "
        "added up. CPU per request from /proc.",
        "",
        *distance_table(run),
        "",
        "## Where the CPU goes (memory:// pair)",
        "",
        "CPU per request from /proc: the gunicorn workers (app) and the pool's PostgreSQL "
        "backends; then the cores wrk used, and those every other process on the machine used "
        "meanwhile (noise, when it is not 0).",
        "",
        *cpu_table(run),
        "",
        f"## Cost against table size ({largest:,} pets, 1 connection)",
        "",
        "One connection (no queueing), rounds of 1 s with each page on each server in turn; the "
        "median of the rounds' median latencies. Target: the deep page and a filtered page "
        "within 1.2× of the first page. The PostgreSQL column is the floor's backends' CPU per "
        "request, the part that would grow with the table.",
        "",
        *size_table(run),
        "",
        "## The limiter's cost per request",
        "",
        "In-process: the app answers `GET /v1/pets?limit=1` through Flask's test client with the "
        "limiter off, on memory:// and on redis:// (petstore.storages), and on the `limits` "
        "library's own MemoryStorage and RedisStorage for comparison; the apps side by side, "
        f"{LIMITER_ROUNDS} interleaved rounds of {args.limiter_requests} "
        "requests after one to warm up, the median round. Wall time includes waiting for Redis "
        "and PostgreSQL; CPU time is this process's only.",
        "",
        "| limiter | wall µs/request | limiter's cost | CPU µs/request | limiter's CPU |",
        "|---|---:|---:|---:|---:|",
        *(
            f"| {name} | {wall:,.0f} | {wall - off_wall:+,.0f} | {cpu:,.0f} | {cpu - off_cpu:+,.0f} |"
            for name, (wall, cpu) in run.limiter_us.items()
        ),
        "",
        "## Peak RSS per worker (VmHWM, read just before stopping the server)",
        "",
        "| pets | server | MiB per worker |",
        "|---:|---|---|",
        *(
            f"| {size:,} | {label} | {', '.join(f'{kib / 1024:.0f}' for kib in kibs)} |"
            for (size, label), kibs in run.rss_kib.items()
        ),
        "",
        "## Notes",
        "",
        *(f"- {note}" for note in run.notes),
        "",
        f"## Plans at {largest:,} pets (`EXPLAIN (ANALYZE, BUFFERS)` of petstore.queries.pets)",
    ]
    for title, query, plan in run.plans:
        out += ["", f"### {title}", "", "```sql", query, "```", "", "```", plan, "```"]
    out += [
        "",
        "## Commands",
        "",
        "```",
        f"{source}{invocation}    # make bench runs it with the defaults",
        *run.commands.values(),
        "cd bench/wrk && BENCH_KEY=<enterprise key> BENCH_MIN_ID=<min> BENCH_MAX_ID=<max> \\",
        f"    wrk -t{args.threads} -c{args.connections} -d{args.duration}s --latency "
        "--timeout 5s -s <get|follow|pet|post|mixed>.lua http://127.0.0.1:<port><path>",
        "```",
        "",
    ]
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
