"""PostgreSQL's CPU per read at two table sizes, in paired rounds: is a read's cost flat?

    .venv/bin/python -m bench.studies.sizes [--sizes 10000,1000000[,10000000]] [--rounds 5] [--calls 3000]

A scratch database per size, seeded (database.seed: COPY, then vacuum analyze), then churned as
`make bench` churns its table (database.churn: `--churn` creates, their deletion, a plain VACUUM,
no ANALYZE); one connection
to each, its statements prepared as the pool's are. Each round runs every read's query function
`--calls` times on each size in turn (the order rotating each round) and takes the CPU its
backend spent from /proc; each larger size's ratio is the median (min–max) of the rounds' own
ratios to the smallest. Then how often PostgreSQL planned each statement anew (custom plans)
against reusing its generic plan, EXPLAIN (ANALYZE, BUFFERS) of each read at every size, and
the size of the pets relations against shared_buffers.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

from bench.database import Conn, Table, bench_database, churn, explain, seed
from bench.measure import cpu_seconds, log
from bench.numbers import rotation
from petstore.queries import pets


def reads(table: Table) -> dict[str, tuple[Callable[..., Any], dict[str, Any]]]:
    """Each read scenario's query function and arguments at this size (the deep page: `after`
    near the end of the table)."""
    return {
        "GET /v1/pets?limit=20": (pets.list_pets, {"after": 0, "limit": 20}),
        "GET /v1/pets?limit=100&status=available": (
            pets.list_pets_by_status,
            {"status": "available", "after": 0, "limit": 100},
        ),
        "deep page (after near the end)": (
            pets.list_pets,
            {"after": table.max_id - 40, "limit": 20},
        ),
        "GET /v1/pets/{id}": (pets.find_pet, {"pet_id": (table.min_id + table.max_id) // 2}),
    }


def table(sizes: list[int], cpu: dict[tuple[str, int], list[float]], names: list[str]) -> str:
    """Markdown: each read's PostgreSQL µs per call at every size, and each larger size's paired
    ratio to the smallest."""
    small, larger = sizes[0], sizes[1:]
    lines = [
        "| read | "
        + " | ".join(f"PostgreSQL µs per call at {size:,}" for size in sizes)
        + " | "
        + " | ".join(f"**{size:,} ÷ {small:,}** median (min–max)" for size in larger)
        + " |",
        "|---|" + "---:|" * (len(sizes) + len(larger)),
    ]
    for name in names:
        cells = [f"{statistics.median(cpu[(name, size)]):,.0f}" for size in sizes]
        for size in larger:
            ratios = [
                b / a for a, b in zip(cpu[(name, small)], cpu[(name, size)], strict=True) if a
            ]
            cells.append(
                f"**{statistics.median(ratios):.2f}** ({min(ratios):.2f}–{max(ratios):.2f})"
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plan_reuse(conn: Conn) -> str:
    """How often PostgreSQL reused each prepared statement's generic plan on this connection,
    against planning it anew (a custom plan: PostgreSQL plans five of those first)."""
    rows = conn.execute(
        """
        select regexp_replace(statement, '\\s+', ' ', 'g') as statement,
               generic_plans, custom_plans
          from pg_prepared_statements
         where statement like '%%from pets%%'
           and statement not like '%%pg_prepared_statements%%'
         order by statement
        """
    ).fetchall()
    return "; ".join(
        f"`…{where(row['statement'])}…` {row['generic_plans']:,} generic, "
        f"{row['custom_plans']:,} custom plans"
        for row in rows
    )


def where(statement: str) -> str:
    """The part of a read's statement that tells it from the others: its WHERE clause."""
    start = statement.find("where")
    return statement[start : statement.find(")", start)].strip()


def backend_pid(conn: Conn) -> int:
    """The pid of the connection's backend (this machine's PostgreSQL)."""
    row = conn.execute("select pg_backend_pid() as pid").fetchone()
    assert row is not None
    return int(row["pid"])


def parse_args() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.studies.sizes", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("--database-url", default=os.environ.get("DATABASE_URL") or None)
    parser.add_argument("--scratch-database", default="petstore_bench_sizes")
    parser.add_argument(
        "--sizes",
        default=[10_000, 1_000_000],
        type=lambda text: sorted(int(each) for each in text.split(",")),
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--churn",
        type=int,
        default=15_000,
        help="creates made and deleted (then a plain VACUUM) after seeding, as a run of "
        "creates in make bench does (default 15000; 0: the freshly analyzed table)",
    )
    # /proc counts CPU in clock ticks (10 ms): 3,000 calls resolve 3.3 µs per call.
    parser.add_argument("--calls", type=int, default=3000, help="calls per read, size and round")
    args = parser.parse_args()
    if len(args.sizes) < 2 or args.rounds < 5:
        parser.error("at least two --sizes, and at least 5 --rounds")
    return args


def main() -> int:
    """Seed both sizes, measure in paired rounds, print the table and the plans."""
    args = parse_args()
    with contextlib.ExitStack() as stack:
        conns: dict[int, Conn] = {}
        tables: dict[int, Table] = {}
        for size in args.sizes:
            scratch = bench_database(args.database_url, f"{args.scratch_database}_{size}")
            _server, _url, _key, conn = stack.enter_context(scratch)
            log(f"seeding {size:,} pets (COPY)")
            tables[size], conns[size] = seed(conn, size), conn
            if args.churn:
                estimate, live = churn(conn, tables[size], args.churn)
                log(f"after {args.churn:,} creates and their deletion: estimate {estimate:,}")
                print(
                    f"{size:,} pets after the churn: the planner's estimate {estimate:,}, {live:,} there"
                )
            conn.prepare_threshold = 0  # prepared at once, as the pool's statements soon are
        cpu: dict[tuple[str, int], list[float]] = {}
        for number in range(args.rounds + 1):
            for size in rotation(args.sizes, number):
                conn, pid = conns[size], backend_pid(conns[size])
                for name, (query, kwargs) in reads(tables[size]).items():
                    before = cpu_seconds([pid])
                    for _ in range(args.calls):
                        query(conn, **kwargs)
                    spent = (cpu_seconds([pid]) - before) / args.calls * 1e6
                    if number:  # the first round warms the caches up
                        cpu.setdefault((name, size), []).append(spent)
        print(table(args.sizes, cpu, list(reads(tables[args.sizes[0]]))))
        for size in args.sizes:
            print(f"\n{size:,} pets: " + plan_reuse(conns[size]))
        for size in args.sizes:
            row = (
                conns[size]
                .execute(
                    "select pg_size_pretty(pg_total_relation_size('pets')) as pets, "
                    "current_setting('shared_buffers') as shared_buffers"
                )
                .fetchone()
            )
            assert row is not None
            print(
                f"\n{size:,} pets: the table with its indexes is {row['pets']} "
                f"(shared_buffers {row['shared_buffers']})"
            )
            for name, (query, kwargs) in reads(tables[size]).items():
                _text, plan = explain(conns[size], query, **kwargs)
                print(f"\n{name}, {size:,} pets:\n\n    " + plan.replace("\n", "\n    "))
    return 0


if __name__ == "__main__":
    sys.exit(main())
