"""The cost of counting usage per request (petstore.usage), in-process: `python -m bench.studies.usage_cost`.

Two numbers, CPU of this thread only (time.thread_time), best of interleaved rounds as timeit
takes them: (1) the per-request call alone, usage.count_request in a request context; (2) a
whole GET /v1/pets?limit=20 through WSGI with the counting and with it replaced by a no-op. And
the PostgreSQL writes it adds: one statement per worker per PETSTORE_USAGE_FLUSH_SECONDS,
whatever the request rate. Needs DATABASE_URL (a migrated database; a key is created in it).
"""

from __future__ import annotations

import argparse
import os
import time
from types import SimpleNamespace

from flask import Response, g

from bench.inprocess import caller, close_app, interleaved_best, no_counting, request_log_to_null
from petstore import config, create_app, db, keys, usage


def call_cost(calls: int, rounds: int) -> float:
    """CPU µs of one usage.count_request, best round."""
    app = create_app({"DATABASE_URL": os.environ["DATABASE_URL"], "USAGE_FLUSH_SECONDS": 3600.0})
    try:
        response = Response(status=200)
        best = float("inf")
        with app.test_request_context("/v1/pets"):
            # What usage reads of a Caller: its key id and plan.
            g.caller = SimpleNamespace(key_id=7, plan="free")
            for _ in range(rounds):
                started = time.thread_time()
                for _ in range(calls):
                    usage.count_request(response)
                best = min(best, time.thread_time() - started)
        return best / calls * 1e6
    finally:
        close_app(app)


def request_costs(requests: int, rounds: int) -> tuple[float, float]:
    """CPU µs of a whole request with the counting and without it, best interleaved rounds."""
    settings = config.from_environ()
    with db.connect(settings) as conn:
        key, _row = keys.issue_key(conn, "enterprise", "bench usage", 10**9, 10**9)
    app = create_app({"USAGE_FLUSH_SECONDS": 3600.0, "IP_LIMITS": "1000000000/minute"})
    handler = request_log_to_null()
    counting = usage.count_request
    call = caller(app, key)
    try:
        best = interleaved_best(
            call,
            {
                "with": lambda: setattr(usage, "count_request", counting),
                "without": lambda: setattr(usage, "count_request", no_counting),
            },
            requests,
            rounds,
        )
    finally:
        usage.count_request = counting
        close_app(app)
        handler.close()
        os.close(handler.fd)
    return best["with"] / requests * 1e6, best["without"] / requests * 1e6


def main() -> None:
    """Print the costs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--workers", type=int, default=3, help="gunicorn workers, for writes/s")
    args = parser.parse_args()
    alone = call_cost(args.calls, args.rounds)
    with_counting, without = request_costs(args.requests, args.rounds)
    flush = config.from_environ()["USAGE_FLUSH_SECONDS"]
    print(f"usage.count_request alone:           {alone:6.2f} µs CPU per request (target ≤ 15)")
    print(f"GET /v1/pets?limit=20 with counting:  {with_counting:6.1f} µs CPU per request")
    print(f"GET /v1/pets?limit=20 without:        {without:6.1f} µs CPU per request")
    print(f"difference (noise included):          {with_counting - without:+6.1f} µs")
    print(
        f"PostgreSQL writes added: {args.workers} workers / {flush:g} s = "
        f"{args.workers / flush:.1f} statements per second at any request rate"
    )


if __name__ == "__main__":
    main()
