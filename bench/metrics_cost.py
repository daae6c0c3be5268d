"""What the Prometheus metrics cost per request, in-process: thread CPU µs with and without them.

Direct WSGI calls of GET /v1/pets?limit=20 (an enterprise key, memory:// limits, 20 pets), in
prometheus_client's multiprocess mode as under gunicorn (a scratch PROMETHEUS_MULTIPROC_DIR),
with and without petstore.metrics.observe_request, interleaved call by call so that drift hits all;
then observe_request alone. Works in a scratch database `petstore_metrics_bench` on the server
of --database-url (or DATABASE_URL), dropped at the end. Runs in well under a minute.

    DATABASE_URL=postgresql://postgres@127.0.0.1:5432/postgres .venv/bin/python bench/metrics_cost.py
"""

from __future__ import annotations

import os
import sys
import tempfile

# Before petstore (and so prometheus_client) is imported: it picks its mode from the environment.
if "--single-process" not in sys.argv:
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="petstore-metrics-bench-")

import argparse
import shutil
import statistics
import time
from collections.abc import Callable
from typing import Any

import psycopg
from flask import Flask, g
from psycopg import conninfo, sql
from werkzeug.test import EnvironBuilder

from petstore import auth, config, create_app, db, metrics

BENCH_DB = "petstore_metrics_bench"
PATH = "/v1/pets?limit=20"
BUDGET_US = 30.0


def start_response(
    status: str, headers: list[tuple[str, str]], exc_info: Any = None, /
) -> Callable[[bytes], object]:
    assert status.startswith("200"), status
    return lambda data: None


def call_once(app: Flask, key: str) -> None:
    """One GET through the whole WSGI app, body consumed."""
    environ = EnvironBuilder(path=PATH, headers=[("Authorization", f"Bearer {key}")]).get_environ()
    body = app.wsgi_app(environ, start_response)
    try:
        for _chunk in body:
            pass
    finally:
        close: Callable[[], None] | None = getattr(body, "close", None)
        if close is not None:
            close()


def cpu_us_per_call(work: Callable[[], object], calls: int) -> float:
    """Thread CPU µs per call of `work`."""
    started = time.thread_time()
    for _ in range(calls):
        work()
    return (time.thread_time() - started) / calls * 1e6


def trimmed_mean(values: list[float], cut: float = 0.05) -> float:
    """The mean without the highest `cut` of the values (preemptions, garbage collections)."""
    kept = sorted(values)[: max(1, int(len(values) * (1 - cut)))]
    return statistics.fmean(kept)


def measure(app: Flask, key: str, calls: int) -> dict[str, float]:
    """Thread CPU µs per request with metrics, without, and without again (the noise), the
    arms interleaved call by call; observe_request alone; one flush of the tally."""
    hooks = app.after_request_funcs[None]
    for _ in range(20):  # warm up: pool, caches, label children
        call_once(app, key)
    # "control" runs the same code as "without": how far apart two runs of it come out.
    runs: dict[str, list[float]] = {"with": [], "without": [], "control": []}
    names = list(runs)
    for n in range(calls):
        # Each arm first in turn, so that none gets the warmer caches.
        for name in names[n % 3 :] + names[: n % 3]:
            if name != "with":
                hooks.remove(metrics.observe_request)
            try:
                started = time.thread_time()
                call_once(app, key)
                runs[name].append((time.thread_time() - started) * 1e6)
            finally:
                if name != "with":
                    hooks.append(metrics.observe_request)
    response = app.response_class("[]", status=200)
    with app.test_request_context(PATH):
        g.started = time.perf_counter()
        alone = cpu_us_per_call(lambda: metrics.observe_request(response), calls)
    # What the sampler thread does once a second in each worker, off the request path.
    flush = cpu_us_per_call(app.extensions[metrics.EXTENSION].flush, 1)
    means = {name: trimmed_mean(values) for name, values in runs.items()}
    return {
        "with": means["with"],
        "without": means["without"],
        "difference": means["with"] - means["without"],
        "control": means["control"] - means["without"],
        "alone": alone,
        "flush": flush,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database-url", default=os.environ.get("DATABASE_URL"))
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument(
        "--single-process", action="store_true", help="without PROMETHEUS_MULTIPROC_DIR"
    )
    args = parser.parse_args()
    if not args.database_url:
        parser.error("give --database-url or set DATABASE_URL (a PostgreSQL server to work on)")
    admin_url = conninfo.make_conninfo(args.database_url, dbname="postgres")
    url = conninfo.make_conninfo(args.database_url, dbname=BENCH_DB)
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(
            sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(BENCH_DB))
        )
        admin.execute(sql.SQL("create database {}").format(sql.Identifier(BENCH_DB)))
    app: Flask | None = None
    try:
        settings = config.from_environ({"DATABASE_URL": url})
        with db.connect(settings) as conn:
            db.upgrade(conn)
            conn.execute(
                "insert into pets (name, category_id, status)"
                " select 'pet ' || n, 1, 'available' from generate_series(1, 20) as n"
            )
            key, _row = auth.issue_key(conn, "enterprise", "bench", 10**9, 10**9)
        app = create_app({"DATABASE_URL": url, "RATELIMIT_STORAGE_URI": "memory://"})
        app.extensions["petstore.pool"].wait(timeout=10)
        mode = "multiprocess" if metrics.multiprocess_mode() else "single-process"
        cost = measure(app, key, args.calls)
        print(f"prometheus_client mode: {mode}; {args.calls} calls of GET {PATH} per arm")
        print(f"thread CPU per request, with metrics:      {cost['with']:7.1f} µs")
        print(f"thread CPU per request, without metrics:   {cost['without']:7.1f} µs")
        print(f"difference:                                {cost['difference']:7.1f} µs")
        print(f"same code twice (the noise of the above):  {cost['control']:7.1f} µs")
        print(f"observe_request alone:                     {cost['alone']:7.1f} µs")
        print(f"one flush of the tally (sampler, 1/s):     {cost['flush']:7.1f} µs")
        print(f"budget per request:                        {BUDGET_US:7.1f} µs")
    finally:
        if app is not None:
            app.extensions["petstore.pool"].close()
        with psycopg.connect(admin_url, autocommit=True) as admin:
            admin.execute(
                sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(BENCH_DB))
            )
        directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if directory and "petstore-metrics-bench-" in directory:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
