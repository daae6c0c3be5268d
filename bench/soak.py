"""`make soak`: the whole stack under mixed load for a long time, a fault every few minutes; a report.

nginx (the shipped site) before two gunicorn instances (deploy/gunicorn.conf.py, 2 workers of 4
threads each), limits in one Redis; the Patroni pair of deploy/patroni.yml (etcd, synchronous
replication), each node with a PgBouncer of its own (deploy/pgbouncer.ini, transaction mode).
DATABASE_URL names HAProxy (deploy/haproxy.cfg), which sends each connection to the PgBouncer of
the node whose Patroni holds the leader lock (GET /primary), so the app follows the primary
through a failover, and never writes to a node that merely accepts writes. A single PgBouncer
cannot: it keeps sending to the host in its [databases] line, which a switchover makes a standby.

Faults, in turn, one in the middle of each slice: kill -9 of the primary node (Patroni and
postmaster; it is started again and rejoins as the synchronous standby), `patronictl
switchover`, kill -9 of the primary's Patroni alone (its postmaster left accepting writes; that
Patroni is started again and demotes it), a Redis restart (a crash: its counters are lost),
kill -9 of a gunicorn worker, and a restart of the primary's PgBouncer. Outside CI: run as root (PostgreSQL runs as
petstore.dev.embedded's account), `make soak SOAK_ARGS="--minutes 4 --fault-every 0.75"` for a short one.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from psycopg import conninfo

from petstore import db
from tests.support.checks import Answer
from tests.support.freshness import FRESH_WITHIN, READ_MAX_LAG, FreshReads
from tests.support.haproxy import HAProxy
from tests.support.load import HTTP_TIMEOUT, MixedLoad
from tests.support.nginx import Deployment, deploy
from tests.support.patroni import Cluster, PatroniNode
from tests.support.pgbouncer import PgBouncer
from tests.support.servers import LOOPBACK, Service, poll_until

RESULTS = Path(__file__).resolve().parent / "results"
CONNECT_TIMEOUT = 2
STATEMENT_TIMEOUT_MS = 2000
ENVIRON = {
    "PETSTORE_PROXY_COUNT": "1",
    "PETSTORE_DB_POOLER": "transaction",
    "PETSTORE_DB_POOL_TIMEOUT": "1",
    "PETSTORE_DB_CONNECT_TIMEOUT": str(CONNECT_TIMEOUT),
    "PETSTORE_DB_RECONNECT_TIMEOUT": "2",
    "PETSTORE_DB_STATEMENT_TIMEOUT_MS": str(STATEMENT_TIMEOUT_MS),
    "PETSTORE_RETRY_AFTER": "1",
    # While there is no primary no key can be looked up: requests spend the address's budget.
    "PETSTORE_IP_LIMITS": "1000000/minute;10000000/day",
}
# Each worker's RSS may move this much (a fraction) from the start of the run to its end.
RSS_FLAT = 0.10
# A failed node is back as the synchronous standby within this (seconds), or the run stops.
REJOIN_WITHIN = 120.0


class SoakLoad(MixedLoad):
    """MixedLoad keeping what the report needs of each answer: status, times, a 201's id.

    Dropping bodies and headers keeps a long run's memory flat (a list is some 5 kB).
    """

    def send(self, method: str, path: str, **extra: Any) -> Answer | None:
        answer = super().send(method, path, **extra)
        if answer is not None:
            answer.raw = b""
            answer.headers.clear()
            if answer.status != 201:
                answer.body = None
        return answer


def node_url(node: PatroniNode) -> str:
    host, port = node.address
    return conninfo.make_conninfo("", host=host, port=str(port), dbname="petstore", user="postgres")


class Stack(Service):
    """etcd and the Patroni pair, a PgBouncer per node, HAProxy, Redis, two gunicorns and nginx;
    a Service (a with block starts and stops it)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.cluster = Cluster(workdir, CONNECT_TIMEOUT)
        self.bouncers = {
            node.node: PgBouncer(workdir / f"pgbouncer-{node.node}", node_url(node))
            for node in self.cluster.nodes
        }
        # Writes follow the leader lock: HAProxy checks each node's Patroni and sends to its
        # PgBouncer (docs/deploying.rst, "Writes follow the leader lock (HAProxy)").
        self.haproxy = HAProxy(
            workdir / "haproxy",
            self.cluster.nodes,
            {name: (LOOPBACK, bouncer.port) for name, bouncer in self.bouncers.items()},
        )
        self.deployment: Deployment | None = None
        # What start() started, stopped in the reverse order.
        self.running = ExitStack()

    def start(self) -> None:
        """The cluster (its statement timeout pinned), the PgBouncers, HAProxy, then the service."""
        self.running.callback(self.cluster.stop)
        self.cluster.start()
        with self.cluster.connect() as conn:
            # Behind a transaction pooler the timeout is the database's
            # (docs/deploying.rst, "Behind PgBouncer (transaction pooling)").
            db.pin_statement_timeout(conn, STATEMENT_TIMEOUT_MS)
        for bouncer in self.bouncers.values():
            self.running.enter_context(bouncer)
        self.running.enter_context(self.haproxy)
        environ = {
            **ENVIRON,
            "DATABASE_URL": self.haproxy.url(connect_timeout=CONNECT_TIMEOUT),
            # Lists and gets on the standby while there is one, the first leader's host first, as
            # docs/deploying.rst shows it ("Reads on standbys").
            "PETSTORE_READ_DATABASE_URL": self.cluster.url(attrs="prefer-standby"),
            "PETSTORE_READ_MAX_LAG_SECONDS": str(READ_MAX_LAG),
            "RATELIMIT_STORAGE_URI": self.cluster.redis.url(),
        }
        self.deployment = self.running.enter_context(
            deploy(environ, self.workdir / "web", instances=2, workers=2, threads=4)
        )

    def stop(self) -> None:
        """Stop whatever start() started, the service first; idempotent."""
        self.deployment = None
        self.running.close()

    @property
    def service(self) -> Deployment:
        """The gunicorns and the nginx before them."""
        assert self.deployment is not None, "the stack is not started"
        return self.deployment

    def bouncer_of(self, node: PatroniNode) -> PgBouncer:
        return self.bouncers[node.node]

    def fail_over(self, kill: Callable[[PatroniNode], None]) -> tuple[PatroniNode, PatroniNode]:
        """`kill` the primary; once the other node leads, start the old one again and wait until it
        is the synchronous standby. (The old primary, the new one.)"""
        old = self.cluster.primary()
        kill(old)
        other = next(node for node in self.cluster.nodes if node is not old)
        if not poll_until(other.is_primary, bool, REJOIN_WITHIN, 0.2):
            raise RuntimeError(f"no failover to {other.node}:\n{other.log()}")
        old.start()
        self.cluster.wait_for_sync_standby(old)
        return old, other

    def kill_primary(self) -> str:
        """kill -9 of the primary's Patroni and postmaster; start it again once the other leads."""
        old, other = self.fail_over(PatroniNode.kill)
        return f"{old.node} killed, {other.node} promoted, {old.node} back as the sync standby"

    def kill_primarys_patroni(self) -> str:
        """kill -9 of the primary's Patroni alone, its postmaster left running; start it again once
        the other leads (it demotes its PostgreSQL)."""
        old, other = self.fail_over(PatroniNode.kill_patroni)
        return f"{old.node}'s Patroni killed, {other.node} promoted, {old.node} demoted and back"

    def switchover(self) -> str:
        """`patronictl switchover` to the synchronous standby."""
        old = self.cluster.primary()
        candidate = self.cluster.standby()
        self.cluster.wait_for_sync_standby(candidate)
        done = old.patronictl(
            "switchover", "--leader", old.node, "--candidate", candidate.node, "--force"
        )
        if done.returncode != 0:
            raise RuntimeError(done.stdout + done.stderr)
        return f"{old.node} -> {candidate.node}"

    def restart_redis(self) -> str:
        """kill -9 of redis-server, then a new, empty one on the same port."""
        self.cluster.redis.stop()
        self.cluster.redis.start()
        return "killed and started again, empty"

    def kill_worker(self) -> str:
        """kill -9 of one gunicorn worker; its master forks another."""
        instance = random.choice(self.service.instances)
        pid = random.choice(instance.worker_pids())
        os.kill(pid, signal.SIGKILL)
        return f"worker {pid} of gunicorn {instance.pid}"

    def restart_primarys_bouncer(self) -> str:
        """Stop the primary's PgBouncer (every client cut), then start it on the same port."""
        primary = self.cluster.primary()
        bouncer = self.bouncer_of(primary)
        bouncer.stop()
        bouncer.start()
        return f"PgBouncer of {primary.node}"

    def cycle(self) -> list[tuple[str, Callable[[], str]]]:
        return [
            ("kill -9 of the primary node", self.kill_primary),
            ("patronictl switchover", self.switchover),
            ("kill -9 of the primary's Patroni alone", self.kill_primarys_patroni),
            ("Redis restart", self.restart_redis),
            ("kill -9 of a gunicorn worker", self.kill_worker),
            ("PgBouncer restart (the primary's)", self.restart_primarys_bouncer),
        ]


def worker_rss(service: Deployment) -> dict[int, int]:
    """pid -> resident set size (kB) of every gunicorn worker right now."""
    sizes = {}
    for instance in service.instances:
        for pid in instance.worker_pids():
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except FileNotFoundError:
                continue
            line = next(line for line in status.splitlines() if line.startswith("VmRSS:"))
            sizes[pid] = int(line.split()[1])
    return sizes


def percentile(values: Sequence[float], fraction: float) -> float:
    """The `fraction` quantile (nearest rank) of `values`; 0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def status_class(status: int) -> str:
    return "503" if status == 503 else f"{status // 100}xx"


@dataclass
class Run:
    """What a run saw, for the report."""

    args: argparse.Namespace
    started: float
    ended: float
    rss_start: dict[int, int]
    rss_end: dict[int, int]
    load: SoakLoad
    reads: FreshReads
    faults: list[tuple[float, str, float, str]]
    rows: int
    rows_of_201s: int
    probe_rows: int


def header(run: Run) -> list[str]:
    """The title and what ran: the command, the machine, the load and the stack."""
    return [
        f"# Soak, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        "",
        f"`python -m bench.soak {' '.join(sys.argv[1:])}` on {platform.node()} "
        f"({os.cpu_count()} cores): {run.args.minutes:g} minutes, a fault every "
        f"{run.args.fault_every:g} minutes (in the middle of each slice), {run.args.clients} "
        "clients of mixed load (creates retried with their Idempotency-Key on 503, lists, gets) "
        "through nginx; two gunicorns of 2 workers x 4 threads, Redis, the Patroni pair with a "
        "PgBouncer (transaction mode) each, DATABASE_URL naming HAProxy, which sends to the "
        "PgBouncer of the node holding Patroni's leader lock.",
        "",
    ]


def faults_section(run: Run) -> list[str]:
    """Each fault: when, which, how long it took, what it did."""
    return [
        "## Faults",
        "",
        "| at (s) | fault | took (s) | what |",
        "|---:|---|---:|---|",
        *(f"| {at:.0f} | {name} | {took:.1f} | {what} |" for at, name, took, what in run.faults),
        "",
    ]


def slice_row(run: Run, number: int) -> str:
    """Slice `number`'s table row: its fault, its answers' latency and their statuses."""
    period = run.args.fault_every * 60
    low, high = run.started + number * period, run.started + (number + 1) * period
    within = [a for a in run.load.answers if low <= a.started < high]
    times = [a.elapsed * 1000 for a in within]
    classes = Counter(status_class(a.status) for a in within)
    fault = next((name for at, name, _, _ in run.faults if low <= run.started + at < high), "")
    other = sum(n for name, n in classes.items() if name.startswith("5") and name != "503")
    return (
        f"| {number * period / 60:g}-{min(run.args.minutes, (number + 1) * period / 60):g} min "
        f"| {fault} "
        f"| {len(within)} | {percentile(times, 0.5):.1f} | {percentile(times, 0.99):.1f} "
        f"| {max(times, default=0):.0f} | {classes['2xx']} | {classes['4xx']} "
        f"| {classes['503']} | {other} |"
    )


def slices_section(run: Run) -> list[str]:
    """A row per slice of `--fault-every` minutes."""
    period = run.args.fault_every * 60
    slices = max(1, math.ceil(run.args.minutes * 60 / period - 1e-6))
    return [
        "## Latency and statuses per slice",
        "",
        "| slice | fault | requests | p50 (ms) | p99 (ms) | longest (ms) | 2xx | 4xx | 503 | other 5xx |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(slice_row(run, number) for number in range(slices)),
        "",
    ]


def statuses_section(run: Run) -> list[str]:
    """The answers by status class and by status, and the requests that had none."""
    answers, failures = run.load.answers, run.load.failures
    every = Counter(a.status for a in answers)
    by_class = Counter(status_class(a.status) for a in answers)
    return [
        "## Statuses",
        "",
        f"{len(answers)} answers: "
        + ", ".join(f"{name} {count}" for name, count in sorted(by_class.items()))
        + " (each status: "
        + ", ".join(f"{status} {count}" for status, count in sorted(every.items()))
        + f"); {len(failures)} requests without an answer (connection refused or "
        f"reset, or {HTTP_TIMEOUT:g} s without one)"
        + (": " + "; ".join(sorted(set(failures))[:10]) if failures else "")
        + ".",
        "",
    ]


def rows_section(run: Run) -> list[str]:
    """The 201s against the rows on the primary at the end, and each create given up."""
    load = run.load
    return [
        "## Rows against the 201s",
        "",
        f"{len(load.created)} 201s answered ({len(set(load.created))} distinct ids); "
        f"{run.rows_of_201s} of those ids are rows on the primary at the end; {run.rows} rows "
        f"of this run in all; {len(load.abandoned)} creates given up (no 201 within "
        f"{load.create_deadline:g} s of retries)" + (":" if load.abandoned else "."),
        "",
        *(f"- {given_up}" for given_up in load.abandoned),
        *([""] if load.abandoned else []),
    ]


def freshness_section(run: Run) -> list[str]:
    """The read probe's pets and listings, in all and per slice (its fault)."""
    period = run.args.fault_every * 60
    slices = max(1, math.ceil(run.args.minutes * 60 / period - 1e-6))
    reads = run.reads
    rows = []
    for number in range(slices):
        low, high = run.started + number * period, run.started + (number + 1) * period
        fault = next((name for at, name, _, _ in run.faults if low <= run.started + at < high), "")
        rows.append(
            f"| {number * period / 60:g} min | {fault} | {reads.summary(reads.between(low, high))} |"
        )
    return [
        "## Read freshness",
        "",
        f"A client created a sold pet, then listed `?status=sold&after=<id - 1>&limit=1` every "
        f"0.1 s for {FRESH_WITHIN + 0.5:g} s, again and again; lists and gets read on the standby "
        f"(PETSTORE_READ_DATABASE_URL prefer-standby, PETSTORE_READ_MAX_LAG_SECONDS "
        f"{READ_MAX_LAG:g}). A listing is stale when it is made more than {FRESH_WITHIN:g} s "
        f"after the pet's 201 and lacks the pet.",
        "",
        f"Stale reads: {len(reads.stale())}. In all: {reads.summary()}; {run.probe_rows} of "
        f"the {len(reads.probes)} probe pets are rows on the primary at the end"
        + (
            f"; answers other than 200, 201 and 503: {reads.unexpected[:5]}"
            if reads.unexpected
            else ""
        )
        + ".",
        "",
        "| slice | fault | the probe |",
        "|---|---|---|",
        *rows,
        "",
    ]


def rss_section(run: Run) -> list[str]:
    """Each worker's RSS at the start and the end; the killed ones and their replacements apart."""
    lines = [
        "## Worker RSS",
        "",
        f"Each worker that lived through the run, at its start and its end (flat means within "
        f"{RSS_FLAT:.0%}); workers that a fault killed, or their replacements, are listed apart.",
        "",
        "| worker | start (MB) | end (MB) | change | flat |",
        "|---|---:|---:|---:|---|",
    ]
    for pid in sorted(run.rss_start.keys() & run.rss_end.keys()):
        start, end = run.rss_start[pid], run.rss_end[pid]
        change = (end - start) / start
        lines.append(
            f"| {pid} | {start / 1024:.1f} | {end / 1024:.1f} | {change:+.1%} "
            f"| {'yes' if abs(change) <= RSS_FLAT else 'NO'} |"
        )
    gone = sorted(run.rss_start.keys() - run.rss_end.keys())
    new = sorted(run.rss_end.keys() - run.rss_start.keys())
    if gone or new:
        lines += [
            "",
            "Killed: "
            + (", ".join(f"{pid} ({run.rss_start[pid] / 1024:.1f} MB)" for pid in gone) or "none")
            + "; started in their place: "
            + (", ".join(f"{pid} ({run.rss_end[pid] / 1024:.1f} MB)" for pid in new) or "none")
            + ".",
        ]
    return [*lines, ""]


def report(run: Run) -> str:
    """The run as markdown: one section after another."""
    return "\n".join(
        [
            *header(run),
            *faults_section(run),
            *slices_section(run),
            *statuses_section(run),
            *rows_section(run),
            *freshness_section(run),
            *rss_section(run),
        ]
    )


def soak(args: argparse.Namespace, workdir: Path) -> Run:
    """Start the stack, run the load and the faults, and gather what the report says."""
    period = args.fault_every * 60
    with Stack(workdir) as stack:
        load = SoakLoad(
            stack.service.url, stack.cluster.key, "soak", clients=args.clients, create_deadline=60
        )
        reads = FreshReads(stack.service.url, stack.cluster.key)
        started = time.monotonic()
        with load.running(), reads.running():
            time.sleep(min(10.0, period / 4))  # every worker has its pool and has answered
            rss_start = worker_rss(stack.service)
            faults = []
            cycle = stack.cycle()
            for number in range(max(1, round(args.minutes * 60 / period))):
                at = started + (number + 0.5) * period
                time.sleep(max(0.0, at - time.monotonic()))
                name, fault = cycle[number % len(cycle)]
                began = time.monotonic()
                what = fault()
                faults.append((began - started, name, time.monotonic() - began, what))
                print(f"{began - started:7.0f} s  {name}: {what}", flush=True)
            time.sleep(max(0.0, started + args.minutes * 60 - time.monotonic()))
            rss_end = worker_rss(stack.service)
        ended = time.monotonic()
        names = load.rows(stack.cluster.connect)
        with stack.cluster.connect() as conn:
            found = conn.execute(
                "select count(*) as n from pets where id = any(%s)", [sorted(set(load.created))]
            ).fetchone()
            probed = conn.execute(
                "select count(*) as n from pets where id = any(%s)",
                [[probe.pet_id for probe in reads.probes]],
            ).fetchone()
        assert found is not None and probed is not None
    return Run(
        args,
        started,
        ended,
        rss_start,
        rss_end,
        load,
        reads,
        faults,
        sum(names.values()),
        found["n"],
        probed["n"],
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--minutes", type=float, default=30, help="length of the run (30)")
    parser.add_argument(
        "--fault-every", type=float, default=5, help="minutes between faults, one a slice (5)"
    )
    parser.add_argument("--clients", type=int, default=8, help="client threads (8)")
    parser.add_argument(
        "--out", type=Path, default=None, help="the report (bench/results/soak-<date>.md)"
    )
    parser.add_argument(
        "--keep",
        type=Path,
        default=None,
        help="keep the stack's files (the service's, nginx's, PostgreSQL's, Patroni's logs) in "
        "this new directory rather than a temporary one",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("the soak runs PostgreSQL as petstore.dev.embedded's account: run it as root")
    out = args.out or RESULTS / f"soak-{datetime.date.today():%Y-%m-%d}.md"
    if args.keep is not None:
        args.keep.mkdir(parents=True)
        run = soak(args, args.keep.resolve())
    else:
        with tempfile.TemporaryDirectory(prefix="petstore-soak-") as workdir:
            run = soak(args, Path(workdir))
    text = report(run)
    out.write_text(text, encoding="utf-8")
    print(text)
    print(f"written to {out}")
    unflat = [
        pid
        for pid in run.rss_start.keys() & run.rss_end.keys()
        if abs(run.rss_end[pid] - run.rss_start[pid]) > RSS_FLAT * run.rss_start[pid]
    ]
    statuses = {a.status for a in run.load.answers}
    lost = run.rows_of_201s != len(set(run.load.created)) or run.probe_rows != len(run.reads.probes)
    if (
        unflat
        or lost
        or run.reads.stale()
        or run.reads.unexpected
        or statuses - {200, 201, 503}
        or run.load.failures
        or run.load.abandoned
    ):
        sys.exit("the soak found a problem: see the report")


if __name__ == "__main__":
    main()
