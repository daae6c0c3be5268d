"""Profile one scenario on the production path: py-spy on the gunicorn workers under wrk through nginx.

    .venv/bin/python -m bench.studies.profile [--scenario "POST /v1/pets"] [--seconds 20] [--output FILE]
    .venv/bin/python -m bench.studies.profile --baseline 067a404     # the service as built at a commit

The service as `make bench` serves its headline (redis://, the default serving configuration,
behind the shipped nginx site) on a scratch database of --size pets; wrk drives the scenario while
py-spy samples every worker (`--subprocesses`, idle samples left out). The report gives the top
frames by their own share of the samples and by their inclusive share (a frame counted once per
sample, wherever it is on the stack), with py-spy's collapsed stacks beside it (`.folded`).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterable
from pathlib import Path

import redis

from bench.database import bench_database, commit_wait, forget_new_pets, scenarios, seed
from bench.measure import ROOT, Measure, ensure_program, log, run_wrk
from bench.servers import PRODUCTION, start_servers

TOP = 25
# Frames every sample has (py-spy's process line, gunicorn's worker loop, runpy): left out of
# the inclusive table, which would otherwise open with them at 100%.
AROUND = ("process ", "<module> (gunicorn", "Arbiter.", "_run_", "run (gunicorn", "Application.")


def parse_args() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.studies.profile", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("--database-url", default=os.environ.get("DATABASE_URL") or None)
    parser.add_argument("--scratch-database", default="petstore_bench_profile")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/9", help="emptied first")
    parser.add_argument(
        "--baseline", metavar="COMMIT", help="profile the service as built at COMMIT instead"
    )
    parser.add_argument("--size", type=int, default=10_000, help="pets in the table")
    parser.add_argument("--scenario", default="POST /v1/pets", help="a scenario of make bench")
    parser.add_argument("--seconds", type=int, default=20, help="wrk's and py-spy's duration")
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument(
        "--output",
        type=Path,
        default=ROOT / "var" / "bench-profile.md",
        help="the report (the collapsed stacks go beside it, .folded)",
    )
    return parser.parse_args()


def py_spy() -> str:
    """The py-spy of the bench extra (this interpreter's bin), else one on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if found is None:
        sys.exit("py-spy is missing: make .venv/.bench-installed (the bench extra has it)")
    return found


def folded_stacks(lines: Iterable[str]) -> collections.Counter[tuple[str, ...]]:
    """py-spy's collapsed stacks ("frame;frame;... count"), root first, as stack -> samples."""
    stacks: collections.Counter[tuple[str, ...]] = collections.Counter()
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if stack and count.isdigit():
            stacks[tuple(stack.split(";"))] += int(count)
    return stacks


def top_frames(
    stacks: collections.Counter[tuple[str, ...]], top: int = TOP
) -> tuple[int, list[tuple[str, float]], list[tuple[str, float]]]:
    """(samples, the `top` frames by own share, by inclusive share), shares of all samples;
    the frames around every request (AROUND) have no inclusive share."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    for stack, count in stacks.items():
        own[stack[-1]] += count
        for frame in set(stack):
            if not frame.startswith(AROUND):
                inclusive[frame] += count
    total = sum(stacks.values())
    if not total:
        return 0, [], []

    def shares(counter: collections.Counter[str]) -> list[tuple[str, float]]:
        return [(frame, count / total) for frame, count in counter.most_common(top)]

    return total, shares(own), shares(inclusive)


def render(
    scenario: str, samples: int, own: list[tuple[str, float]], inclusive: list[tuple[str, float]]
) -> str:
    """The two tables of top frames, in Markdown."""
    lines = [
        f"{samples:,} samples of the gunicorn workers during `{scenario}` (only samples holding "
        "the GIL: Python running, not waiting).",
        "",
    ]
    for title, rows in (
        ("own share (where the CPU is spent)", own),
        ("inclusive share", inclusive),
    ):
        lines += [f"Top frames by {title}:", "", "| share | frame |", "|---:|---|"]
        lines += [f"| {share:.1%} | `{frame}` |" for frame, share in rows]
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    """Start the production-path service, drive it with wrk under py-spy, write the report."""
    args = parse_args()
    for program in ("wrk", "nginx"):
        ensure_program(program)
    spy = py_spy()
    redis.Redis.from_url(args.redis_url, socket_timeout=5).flushdb()
    folded = args.output.with_suffix(".folded")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    scratch = bench_database(args.database_url, args.scratch_database)
    with scratch as (_server_url, database_url, key, conn):
        log(f"seeding {args.size:,} pets (COPY)")
        table = seed(conn, args.size)
        chosen = next(s for s in scenarios(table) if s.name == args.scenario)
        server = PRODUCTION[0]
        if args.baseline:
            server = dataclasses.replace(server, commit=args.baseline)
        with contextlib.ExitStack() as stack:
            running = start_servers(stack, (server,), database_url, args.redis_url, "profile")[
                server
            ]
            target = running.target(key, table)
            run_wrk(target, chosen, 3, args.connections, 1)  # warm-up
            forget_new_pets(conn, table)
            command = [
                spy,
                "record",
                "--pid",
                str(running.gunicorn.pid),
                "--subprocesses",
                "--nonblocking",
                "--gil",
                "--nolineno",
                "--format",
                "raw",
                "--rate",
                str(args.rate),
                "--duration",
                str(args.seconds),
                "--output",
                str(folded),
            ]
            log(f"py-spy on {server.label} during {args.seconds} s of {chosen.name}")
            spy_process = subprocess.Popen(
                command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
            )
            found: list[Measure] = []
            wrk = threading.Thread(
                target=lambda: found.append(
                    run_wrk(target, chosen, args.seconds, args.connections, 1)
                )
            )
            wrk.start()
            wrk.join()
            try:
                _out, errors = spy_process.communicate(timeout=args.seconds + 60)
            except BaseException:
                spy_process.kill()
                spy_process.wait()
                raise
            forget_new_pets(conn, table)
        if spy_process.returncode != 0 or not folded.exists():
            sys.exit(f"py-spy failed ({spy_process.returncode}): {errors}")
        log("createPet's statement with synchronous_commit on and off, in turn")
        wait_on, wait_off = commit_wait(conn)
    measure = found[0]
    samples, own, inclusive = top_frames(folded_stacks(folded.read_text().splitlines()))
    header = (
        f"{server.label}, {args.size:,} pets, {args.seconds} s of `{chosen.name}` with "
        f"{args.connections} connections; wrk: {measure.rps:,.0f} req/s, p99 "
        f"{measure.p99_ms:.2f} ms, app {measure.app_us or 0:,.0f} µs CPU per request (under "
        "py-spy, which slows the workers: compare shares, not these)."
    )
    commit = (
        f"createPet's statement alone (one connection, median of 200): {wait_on:,.0f} µs with "
        f"synchronous_commit on (as shipped), {wait_off:,.0f} µs off: the commit's wait for its "
        f"WAL flush is {wait_on - wait_off:,.0f} µs of a create, spent waiting, not computing."
    )
    report = f"{header}\n\n{commit}\n\n{render(chosen.name, samples, own, inclusive)}"
    args.output.write_text(report)
    print(report)
    log(f"report written to {args.output}, collapsed stacks to {folded}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
