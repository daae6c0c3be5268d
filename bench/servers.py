"""The servers under test: which app, how it is served (gunicorn with deploy/gunicorn.conf.py, behind
the shipped nginx site or not), started on free loopback ports and stopped with the run.

The harness of the system tests starts them (tests/support): DeployedGunicorn and Nginx, which
renders deploy/nginx/petstore.conf with only its addresses and paths replaced.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import multiprocessing
import os
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.database import Table
from bench.measure import ROOT, Target, process_tree
from tests.support.nginx import DeployedGunicorn, Nginx
from tests.support.servers import LOOPBACK

# path -> (status, parsed JSON, Link header, raw body)
Answers = dict[str, tuple[int, Any, str | None, bytes]]
LOG_DIR = ROOT / "var" / "bench-logs"
BASELINE_DIR = ROOT / "var" / "bench-baseline"
GUNICORN_CONFIG = "deploy/gunicorn.conf.py"
NGINX_CONFIG = "deploy/nginx/petstore.conf"
SERVICE, FLASK_FLOOR, RAW_FLOOR = "service", "bare-Flask floor", "raw floor"
# The service with flask-limiter switched off; gunicorn calls the factory (literal arguments only).
ABLATION_APP = "petstore:create_app({'RATELIMIT_ENABLED': False})"
# nginx as Debian runs it (`worker_processes auto`): one worker per core.
NGINX_WORKERS = multiprocessing.cpu_count()


@dataclass(frozen=True)
class Server:
    """A server under test: which app, its limiter storage, workers × threads, class, ablations,
    and whether wrk reaches it through nginx.

    `without` switches parts of the service off, to show what they cost: "limiter" (the
    factory called with RATELIMIT_ENABLED off), "request log" (PETSTORE_LOG_LEVEL=warning),
    "synchronous commit" (synchronous_commit off on its connections) and "leases" (every key
    counted request by request: PETSTORE_RATELIMIT_HOT_RATE=0).
    """

    app: str  # SERVICE, FLASK_FLOOR or RAW_FLOOR
    storage: str  # "memory" or "redis"
    workers: int
    threads: int = 4
    worker_class: str = "gthread"
    without: tuple[str, ...] = ()
    nginx: bool = False
    commit: str = ""  # the service as built at this commit (--baseline), else the work tree's
    pets: int = 0  # the table it serves, when a run has two (the size comparison)

    @property
    def name(self) -> str:
        """The app, the commit it was built at (when not the work tree's), the parts it is without."""
        built = f" @{self.commit}" if self.commit else ""
        return f"{self.app}{built}{self.parts_off}{self.table}"

    @property
    def table(self) -> str:
        """' at N pets', or '' when the server has the run's one table."""
        return f" at {self.pets:,} pets" if self.pets else ""

    @property
    def parts_off(self) -> str:
        """' without the ...', or ''."""
        return f" without the {' and the '.join(self.without)}" if self.without else ""

    @property
    def label(self) -> str:
        """How the report names it."""
        storage = f" {self.storage}://" if self.app != RAW_FLOOR else ""
        built = f" @{self.commit}" if self.commit else ""
        via = " via nginx" if self.nginx else ""
        return (
            f"{self.app}{built}{storage} {self.worker_class} {self.workers}×{self.threads}"
            f"{self.parts_off}{via}{self.table}"
        )


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


class BenchGunicorn(DeployedGunicorn):
    """The harness's deployed gunicorn (deploy/gunicorn.conf.py), serving an app of our choice.

    `environ` is the whole environment (server_env leaves out the caller's service settings);
    ready when /healthz answers and every worker is up.
    """

    def start(self) -> None:
        """Start it with exactly `environ`, and wait (bounded) until every worker is up."""
        self.launch(self.command(), cwd=self.tree, env={**self.environ, "PYTHONUNBUFFERED": "1"})

    def answers(self) -> bool:
        """/healthz answers 200 and the master has all its workers."""
        return super().answers() and len(self.worker_pids()) == self.workers


@dataclass
class Running:
    """A started server: its gunicorn, and the nginx in front of it when wrk goes through one."""

    gunicorn: BenchGunicorn
    nginx: Nginx | None

    @property
    def port(self) -> int:
        """Where clients send requests: nginx's port, else gunicorn's."""
        return self.nginx.port if self.nginx else self.gunicorn.port

    def app_pids(self) -> list[int]:
        """gunicorn's master and workers."""
        return process_tree(self.gunicorn.pid)

    def nginx_pids(self) -> list[int] | None:
        """nginx's master and workers, or None without nginx."""
        return process_tree(self.nginx.pid) if self.nginx else None

    def worker_pids(self) -> list[int]:
        """gunicorn's workers."""
        return self.gunicorn.worker_pids()

    def target(self, key: str, table: Table) -> Target:
        """wrk's target: this server's port and processes, the key and the ids of `table`."""
        env = {
            **os.environ,
            "BENCH_KEY": key,
            "BENCH_MIN_ID": str(table.min_id),
            "BENCH_MAX_ID": str(table.max_id),
        }
        return Target(self.port, self.app_pids, self.nginx_pids, env)


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
    if server.nginx:
        env["PETSTORE_PROXY_COUNT"] = "1"  # as deployed: the app trusts nginx's one hop
    if "request log" in server.without:
        env["PETSTORE_LOG_LEVEL"] = "warning"  # the request log is written at info
    if "synchronous commit" in server.without:
        # libpq passes it to every connection of the pool: a commit no longer waits for its WAL
        # flush. Only to measure what that wait costs; never a setting to serve with.
        env["PGOPTIONS"] = "-c synchronous_commit=off"
    if "leases" in server.without:
        env["PETSTORE_RATELIMIT_HOT_RATE"] = "0"
    return env


def server_app(server: Server) -> list[str]:
    """gunicorn's app argument for a server (gunicorn imports it from the repository root)."""
    if server.app == RAW_FLOOR:
        return ["bench.floor:create_floor()"]
    if server.app == FLASK_FLOOR:
        return ["bench.flask_floor:create_flask_floor()"]
    if "limiter" in server.without:
        return [ABLATION_APP]
    return ["wsgi:app"]


def shown_command(server: Server) -> str:
    """The server's command line for the report: no paths, no secrets."""
    storage = "memory://" if server.storage == "memory" else "redis://..."
    settings = [
        f"RATELIMIT_STORAGE_URI={storage}",
        f"WEB_CONCURRENCY={server.workers}",
        f"PETSTORE_THREADS={server.threads}",
        f"GUNICORN_WORKER_CLASS={server.worker_class}",
    ]
    if server.nginx:
        settings.append("PETSTORE_PROXY_COUNT=1")
    if "request log" in server.without:
        settings.append("PETSTORE_LOG_LEVEL=warning")
    if "synchronous commit" in server.without:
        settings.append("PGOPTIONS='-c synchronous_commit=off'")
    if "leases" in server.without:
        settings.append("PETSTORE_RATELIMIT_HOT_RATE=0")
    command = [".venv/bin/python", "-m", "gunicorn", "-c", GUNICORN_CONFIG, *server_app(server)]
    shown = f"DATABASE_URL=<bench database> BIND=127.0.0.1:<port> {' '.join(settings)} "
    shown += shlex.join(command)
    if server.commit:
        shown += f"  # in the files of commit {server.commit} (git archive, var/bench-baseline/)"
    if server.nginx:
        shown += (
            f"  # behind nginx: {NGINX_CONFIG} with its upstream server, listen address and "
            f"access log replaced (tests/support/nginx.py), {NGINX_WORKERS} workers"
        )
    return shown


def baseline_tree(commit: str) -> Path:
    """The repository's files at `commit` (git archive), under var/bench-baseline/: the service
    as it was built then, which gunicorn imports ahead of the work tree's (the working directory
    comes first on sys.path)."""
    tree = BASELINE_DIR / commit
    if not (tree / "wsgi.py").exists():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "archive", "--format=tar", commit],
            cwd=ROOT,
            check=True,
            capture_output=True,
            timeout=120,
        )
        subprocess.run(
            ["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True, timeout=120
        )
    return tree


def start_servers(
    stack: contextlib.ExitStack,
    servers: tuple[Server, ...],
    database_url: str,
    redis_url: str,
    name: str,
    commands: dict[str, str] | None = None,
) -> dict[Server, Running]:
    """Start each server on a free port (and its nginx), stopped when `stack` closes; note in
    `commands` how each is started, by its label, for the report."""
    started: dict[Server, Running] = {}
    for server in servers:
        if commands is not None:
            commands.setdefault(server.label, shown_command(server))
        env = server_env(server, database_url, redis_url)
        log_name = f"{name}-{server.label}".replace(" ", "-").replace("://", "").replace("×", "x")
        gunicorn = BenchGunicorn(
            env,
            LOG_DIR / f"{log_name}.log",
            workers=server.workers,
            threads=server.threads,
            stop_timeout=30.0,
            app=server_app(server),
            tree=baseline_tree(server.commit) if server.commit else ROOT,
        )
        stack.enter_context(gunicorn)
        nginx = None
        if server.nginx:
            nginx = Nginx([gunicorn.address], LOG_DIR / f"{log_name}-nginx", workers=NGINX_WORKERS)
            stack.enter_context(nginx)
        started[server] = Running(gunicorn, nginx)
    return started


def sample_answers(port: int, key: str, paths: list[str]) -> Answers:
    """Status, parsed JSON, Link header and raw body of a few requests."""
    answers = {}
    for path in paths:
        status, headers, body = get(port, path, key)
        answers[path] = (status, json.loads(body), headers.get("Link"), body)
    return answers


def compare_answers(reference: Answers, answers: Answers, label: str) -> list[str]:
    """Where a server answers differently from the service (status, JSON, Link, bytes)."""
    notes = []
    for path, (status, body, link, raw) in answers.items():
        want = reference[path]
        if status != want[0] or (status < 400 and (body, link) != want[1:3]):
            notes.append(f"{label} answers `{path}` unlike the service: {status} {raw[:100]!r}")
        elif status < 400 and raw != want[3]:
            notes.append(f"{label}: the same JSON as the service for `{path}`, other bytes")
    return notes


def get(port: int, path: str, key: str | None = None) -> tuple[int, dict[str, str], bytes]:
    """GET a path of a server: status, headers, body."""
    connection = http.client.HTTPConnection(LOOPBACK, port, timeout=5)
    try:
        connection.request("GET", path, headers={"Authorization": f"Bearer {key}"} if key else {})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()
