"""Faults under load through nginx and two gunicorn instances, on throwaway PostgreSQL and Redis servers.

Each fault runs for a few seconds under a mixed load (creates with an Idempotency-Key, retried on 503
like a good client; lists; gets). Counted per fault: every answer, its latency, and the rows the
creates left. Then a sustained mixed load with no fault and no 5xx. The table of every run comes
in pytest's summary at the end; `pytest -rP` shows each test's own row too.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from petstore import config, db, keys
from tests.support import reports
from tests.support.checks import Answer, call
from tests.support.nginx import DeployedGunicorn, Nginx
from tests.support.pgbouncer import PgBouncer
from tests.support.redis_servers import RedisReplica, RedisSentinel, RedisServer
from tests.support.servers import Service, ThrowawayPostgres, poll_until, run_every

APP_DBNAME = "petstore"
# The app's bounds, small so that a fault is noticed within about a second; all ordinary settings.
POOL_TIMEOUT = 1.0
CONNECT_TIMEOUT = 1
STATEMENT_TIMEOUT_MS = 2000
REDIS_TIMEOUT = 0.25
RETRY_AFTER = 1
ENVIRON = {
    "PETSTORE_PROXY_COUNT": "1",
    "PETSTORE_DB_POOL_TIMEOUT": str(POOL_TIMEOUT),
    "PETSTORE_DB_CONNECT_TIMEOUT": str(CONNECT_TIMEOUT),
    "PETSTORE_DB_RECONNECT_TIMEOUT": "2",
    "PETSTORE_DB_STATEMENT_TIMEOUT_MS": str(STATEMENT_TIMEOUT_MS),
    "PETSTORE_REDIS_TIMEOUT": str(REDIS_TIMEOUT),
    "PETSTORE_RETRY_AFTER": str(RETRY_AFTER),
    # While PostgreSQL is down no key can be looked up, so requests spend the per-IP budget.
    "PETSTORE_IP_LIMITS": "1000000/minute;10000000/day",
}
# The longest a request may wait inside the app before it answers 503 (a pool wait, a connection
# attempt, a statement); the client gives up a second later, and that counts as a failure.
APP_BOUND = POOL_TIMEOUT + CONNECT_TIMEOUT + STATEMENT_TIMEOUT_MS / 1000
CLIENT_TIMEOUT = APP_BOUND + 1.0
CLIENTS = 4
WARMUP = 1.0
AFTER_FAULT = 3.0
# Every request started this long before the end of a run must succeed: the service recovered.
RECOVERED_TAIL = 1.0
# A create retried for this long without a 201 is given up (and fails the test).
CREATE_DEADLINE = 15.0
SUSTAINED = 30.0
# Down longer than a pool wait, so that requests do notice.
POSTGRES_DOWN = 1.5
REDIS_DOWN = 1.5
# A stopped master drains its workers (GUNICORN_GRACEFUL_TIMEOUT is 8 s in tests) and exits.
STOPPED_WITHIN = 10.0
WORKERS = 2
THREADS = 4

RESULTS: list[Result] = []


@dataclass
class Attempt:
    """One HTTP request of the load and what came of it; status 0 means no (whole) answer."""

    op: str
    status: int
    started: float
    elapsed: float
    request_id: str = ""
    from_proxy: bool = False
    problem: str = ""
    cut: bool = False

    def in_flight_at(self, moment: float) -> bool:
        """Whether the request was under way at `moment`."""
        return self.started <= moment <= self.started + self.elapsed


@dataclass
class Result:
    """One row of the outcome table."""

    fault: str
    requests: int
    ok: int
    unavailable: int
    from_proxy: int
    cut: int
    other: int
    max_latency: float
    recovered_after: float
    creates: int
    retried_creates: int

    HEADER = (
        f"{'fault':<26} {'requests':>8} {'2xx':>6} {'503':>5} {'(nginx)':>7} {'cut':>3} {'other':>5} "
        f"{'max latency':>11} {'recovered after':>15} {'creates':>7} {'retried':>7}"
    )

    def row(self) -> str:
        """The result as a line of the table."""
        return (
            f"{self.fault:<26} {self.requests:>8} {self.ok:>6} {self.unavailable:>5} "
            f"{self.from_proxy:>7} {self.cut:>3} {self.other:>5} {self.max_latency:>9.2f} s "
            f"{self.recovered_after:>13.2f} s {self.creates:>7} {self.retried_creates:>7}"
        )


def print_table(results: list[Result]) -> None:
    """The outcome table (shown by `pytest -rP`, or at once with -s)."""
    print(Result.HEADER)
    for result in results:
        print(result.row())


class Stack(Service):
    """Throwaway PostgreSQL and Redis, two gunicorn instances (shipped config) and nginx (shipped
    site); a Service (a with block starts and stops it)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.cluster = ThrowawayPostgres(workdir / "pgdata")
        self.redis = RedisServer(workdir / "redis")
        self.instances: list[DeployedGunicorn] = []
        self.nginx: Nginx | None = None
        self.key = ""
        self.database_url = ""

    def start(self) -> None:
        """Start everything: a migrated database with a key of ample budget, Redis, two instances, nginx."""
        self.cluster.start()
        self.database_url = self.cluster.migrated_database(APP_DBNAME)
        with self.connect() as conn:
            self.key, _row = keys.issue_key(conn, "enterprise", "faults", 10_000_000, 100_000_000)
        self.redis.start()
        self.start_web(
            {"DATABASE_URL": self.database_url, "RATELIMIT_STORAGE_URI": self.redis.url()}
        )

    def start_web(self, environ: dict[str, str]) -> None:
        """Two instances (with ENVIRON and `environ`) and nginx in front of them."""
        environ = {**ENVIRON, **environ}
        for number in range(2):
            instance = DeployedGunicorn(
                environ, self.workdir / f"gunicorn-{number}.log", workers=WORKERS, threads=THREADS
            )
            self.instances.append(instance)
            instance.start()
        self.nginx = Nginx(
            [instance.address for instance in self.instances], self.workdir / "nginx"
        )
        self.nginx.start()

    def restore(self) -> None:
        """Bring back whatever the last fault left down (each step is a no-op when it runs)."""
        self.cluster.start()
        if self.redis.process is None:
            self.redis.start()
        for instance in self.instances:
            if instance.process is None or instance.process.poll() is not None:
                instance.stop()
                instance.start()
            instance.wait_for_workers()

    def stop(self) -> None:
        """Stop every process, whatever happens to each."""
        steps: list[Callable[[], None]] = []
        if self.nginx is not None:
            steps.append(self.nginx.stop)
        steps += [instance.stop for instance in self.instances]
        steps += [self.redis.stop, self.cluster.stop]
        run_every(steps)

    def connect(self) -> db.Connection:
        """A direct connection to the throwaway database."""
        return db.connect(config.from_environ({"DATABASE_URL": self.database_url}))

    @property
    def url(self) -> str:
        """nginx's address."""
        assert self.nginx is not None
        return self.nginx.url


class ScaledStack(Stack):
    """The stack's PostgreSQL behind PgBouncer (deploy/pgbouncer.ini, PETSTORE_DB_POOLER=transaction),
    and Redis Sentinel (a master, a replica, three sentinels) instead of one Redis: two more
    instances and an nginx of its own."""

    def __init__(self, workdir: Path, base: Stack) -> None:
        super().__init__(workdir)
        self.cluster = base.cluster
        self.database_url = base.database_url
        self.key = base.key
        self.pgbouncer = PgBouncer(workdir / "pgbouncer", base.database_url, dbname=APP_DBNAME)
        self.replica = RedisReplica(workdir / "replica", self.redis.port)
        self.sentinels = [
            RedisSentinel(workdir / f"sentinel-{n}", self.redis.port) for n in range(3)
        ]

    def start(self) -> None:
        """The statement timeout pinned for the pooler, PgBouncer, Sentinel (settled), instances, nginx."""
        with self.connect() as conn:
            db.pin_statement_timeout(conn, STATEMENT_TIMEOUT_MS)
        self.pgbouncer.start()
        self.redis.start()
        self.replica.start()
        for sentinel in self.sentinels:
            sentinel.start()
        settled = poll_until(
            lambda: all(
                sentinel.master().get("num-other-sentinels") == "2"
                and sentinel.master().get("num-slaves") == "1"
                for sentinel in self.sentinels
            ),
            bool,
            within=30.0,
            interval=0.2,
        )
        assert settled, [sentinel.master() for sentinel in self.sentinels]
        hosts = ",".join(f"127.0.0.1:{sentinel.port}" for sentinel in self.sentinels)
        self.start_web(
            {
                "DATABASE_URL": self.pgbouncer.url(),
                "PETSTORE_DB_POOLER": "transaction",
                "RATELIMIT_STORAGE_URI": f"redis+sentinel://{hosts}/{self.sentinels[0].service}",
            }
        )

    def restore(self) -> None:
        """PgBouncer back if a fault left it down, then the rest as for Stack."""
        if self.pgbouncer.process is None:
            self.pgbouncer.start()
        super().restore()

    def stop(self) -> None:
        """Stop every process of its own (PostgreSQL is the base stack's)."""
        steps: list[Callable[[], None]] = []
        if self.nginx is not None:
            steps.append(self.nginx.stop)
        steps += [instance.stop for instance in self.instances]
        steps += [sentinel.stop for sentinel in self.sentinels]
        steps += [self.replica.stop, self.redis.stop, self.pgbouncer.stop]
        run_every(steps)


class Load:
    """Client threads sending creates (Idempotency-Key, retried on 503), lists and gets through nginx."""

    def __init__(self, base_url: str, key: str, label: str, clients: int = CLIENTS) -> None:
        self.base_url = base_url
        self.headers = {"Authorization": f"Bearer {key}"}
        self.label = label
        self.attempts: list[Attempt] = []
        self.created: list[tuple[int, str]] = []
        self.abandoned: list[str] = []
        self.retried_creates = 0
        self.stopping = threading.Event()
        self.stopped_at = 0.0
        self.fault_at = 0.0
        self.threads = [
            threading.Thread(target=self.client, args=(n,), name=f"load-{n}", daemon=True)
            for n in range(clients)
        ]

    def start(self) -> None:
        """Start the clients."""
        for thread in self.threads:
            thread.start()

    def stop(self) -> None:
        """Stop the clients (creates under way finish or give up first); bounded."""
        self.stopped_at = time.monotonic()
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=CREATE_DEADLINE + CLIENT_TIMEOUT + 5)
        hung = [thread.name for thread in self.threads if thread.is_alive()]
        assert not hung, f"load clients still running: {hung}"

    def client(self, number: int) -> None:
        """One client: create, list, get one of its pets; again until stopped."""
        own: list[int] = []
        step = 0
        while not self.stopping.is_set():
            step += 1
            if step % 3 == 1:
                pet_id = self.create(f"{self.label}-{number}-{step}")
                if pet_id is not None:
                    own.append(pet_id)
            elif step % 3 == 2:
                self.send("list", "GET", "/v1/pets?limit=20")
            elif own:
                self.send("get", "GET", f"/v1/pets/{own[step % len(own)]}")

    def send(self, op: str, method: str, path: str, **extra: Any) -> Answer | None:
        """One request, recorded; after a 503 wait Retry-After (a good client), after no answer 0.5 s."""
        started = time.monotonic()
        try:
            answer = call(
                self.base_url,
                method,
                path,
                headers={**self.headers, **extra.pop("headers", {})},
                timeout=CLIENT_TIMEOUT,
                **extra,
            )
        except OSError as exc:
            elapsed = time.monotonic() - started
            cut = isinstance(exc, ConnectionError)
            self.attempts.append(Attempt(op, 0, started, elapsed, problem=repr(exc), cut=cut))
            time.sleep(0.5)
            return None
        attempt = Attempt(
            op,
            answer.status,
            started,
            answer.elapsed,
            request_id=answer.header("x-request-id") or "",
            # nginx's own 503 comes without the app's rate-limit headers.
            from_proxy=answer.status == 503 and "x-ratelimit-limit" not in answer.headers,
        )
        if not 200 <= answer.status < 300:
            attempt.problem = problem_with(answer)
        self.attempts.append(attempt)
        if answer.status == 503:
            time.sleep(min(float(answer.header("retry-after") or 1), 2.0))
        return answer

    def create(self, name: str) -> int | None:
        """Create a pet, retrying with the same Idempotency-Key until a 201 (bounded); its id."""
        idempotency_key = uuid.uuid4().hex
        deadline = time.monotonic() + CREATE_DEADLINE
        tries = 0
        while time.monotonic() < deadline:
            tries += 1
            answer = self.send(
                "create",
                "POST",
                "/v1/pets",
                headers={"Idempotency-Key": idempotency_key},
                json_body={"name": name, "categoryId": 7, "status": "available"},
            )
            if answer is not None and answer.status == 201:
                self.created.append((answer.body["id"], name))
                self.retried_creates += tries > 1
                pet_id: int = answer.body["id"]
                return pet_id
            if answer is not None and answer.status != 503:
                break
        self.abandoned.append(name)
        return None


def problem_with(answer: Answer) -> str:
    """'' for a well-formed 503 (Error JSON with Retry-After), else what is wrong with the answer."""
    if answer.status != 503:
        return f"status {answer.status}: {answer.raw[:200]!r}"
    if not answer.is_json_error or answer.body["code"] != "service_unavailable":
        return f"503 that is not the Error JSON: {answer.headers} {answer.raw[:200]!r}"
    if not (answer.header("retry-after") or "").isdigit():
        return f"503 without Retry-After: {answer.headers}"
    return ""


def run_fault(
    stack: Stack, name: str, fault: Callable[[], None], *, kills: bool = False
) -> tuple[Load, Result]:
    """Run the load, inject `fault` after WARMUP, keep the load on for AFTER_FAULT; check and count.

    `kills`: the fault kills a process that may be writing an answer, which may cut it short.
    """
    stack.restore()
    load = Load(stack.url, stack.key, label=name.replace(" ", "-"))
    load.start()
    try:
        time.sleep(WARMUP)
        load.fault_at = time.monotonic()
        fault()
        time.sleep(AFTER_FAULT)
    finally:
        load.stop()
    result = summarize(name, load, load.fault_at)
    RESULTS.append(result)
    print_table([result])
    check_load(stack, load, kills=kills)
    return load, result


def outage(service: Service, seconds: float) -> Callable[[], None]:
    """A fault: stop the service, leave it down for `seconds`, start it again."""

    def fault() -> None:
        service.stop()
        time.sleep(seconds)
        service.start()

    return fault


def summarize(name: str, load: Load, fault_at: float) -> Result:
    """The table row of a run."""
    attempts = load.attempts
    statuses = Counter(attempt.status for attempt in attempts)
    failed = [attempt for attempt in attempts if not 200 <= attempt.status < 300]
    last_failure = max((a.started + a.elapsed for a in failed), default=fault_at)
    return Result(
        fault=name,
        requests=len(attempts),
        ok=sum(n for status, n in statuses.items() if 200 <= status < 300),
        unavailable=statuses[503],
        from_proxy=sum(attempt.from_proxy for attempt in attempts),
        cut=sum(attempt.cut for attempt in attempts),
        other=sum(not a.cut and a.status != 503 and not 200 <= a.status < 300 for a in attempts),
        max_latency=max(attempt.elapsed for attempt in attempts),
        recovered_after=max(0.0, last_failure - fault_at),
        creates=len(load.created),
        retried_creates=load.retried_creates,
    )


def cut_by_kill(load: Load) -> list[Attempt]:
    """Answers cut short because the process writing them was killed at the fault.

    A worker killed between the headers of an answer and its body leaves nginx, and so the client,
    with half an answer: HTTP cannot take a status line back. Only requests under way at that
    instant can be cut, at most one per thread of the killed worker.
    """
    cut = [
        attempt for attempt in load.attempts if attempt.cut and attempt.in_flight_at(load.fault_at)
    ]
    assert len(cut) <= THREADS, f"more answers cut short than the killed worker had threads: {cut}"
    return cut


def check_load(stack: Stack, load: Load, *, kills: bool = False) -> None:
    """Bounded latency, only well-formed 503s, recovered at the end, every 201 a row and no duplicate.

    `kills`: answers cut short by the kill are allowed; a create cut short is retried with its
    Idempotency-Key like any other failure, so the rows still match the 201s.
    """
    attempts = load.attempts
    assert len(attempts) >= 50, f"too little load to prove anything: {len(attempts)} requests"
    slow = [attempt for attempt in attempts if attempt.elapsed >= CLIENT_TIMEOUT - 0.5]
    assert not slow, f"requests near or past the client timeout ({CLIENT_TIMEOUT} s): {slow[:5]}"
    forgiven = {id(attempt) for attempt in cut_by_kill(load)} if kills else set()
    bad = [attempt for attempt in attempts if attempt.problem and id(attempt) not in forgiven]
    assert not bad, f"{len(bad)} failures that are not a 503 Error JSON: {bad[:5]}"
    tail = [a for a in attempts if a.started >= load.stopped_at - RECOVERED_TAIL]
    assert len(tail) >= 5, f"only {len(tail)} requests at the end of the run"
    failing_tail = [attempt for attempt in tail if not 200 <= attempt.status < 300]
    assert not failing_tail, f"not recovered at the end of the run: {failing_tail[:5]}"

    assert not load.abandoned, f"creates never answered 201: {load.abandoned}"
    with stack.connect() as conn:
        rows = conn.execute(
            "select id, name from pets where name like %(prefix)s",
            {"prefix": f"{load.label}-%"},
        ).fetchall()
    stored = {(row["id"], row["name"]) for row in rows}
    lost = [pet for pet in load.created if pet not in stored]
    assert not lost, f"201s without a row: {lost}"
    names = Counter(row["name"] for row in rows)
    twice = [name for name, n in names.items() if n > 1]
    assert not twice, f"created more than once despite the Idempotency-Key: {twice}"
    assert len(rows) == len(load.created), (len(rows), len(load.created))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The module's stack; the outcome table of every fault in the run's summary at the end."""
    try:
        with Stack(tmp_path_factory.mktemp("faults")) as running:
            yield running
    finally:
        if RESULTS:
            # In pytest's summary at the end of the run (and so in CI's log), not among the dots.
            reports.add(
                "Faults under load, through nginx and two gunicorn instances",
                [Result.HEADER, *(result.row() for result in RESULTS)],
            )


@pytest.fixture(scope="module")
def scaled(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScaledStack]:
    """The module's PostgreSQL behind PgBouncer, with Redis Sentinel: two more instances and nginx."""
    with ScaledStack(tmp_path_factory.mktemp("faults-scaled"), stack) as running:
        yield running


def reads(load: Load) -> list[Attempt]:
    """The GET requests of a run."""
    return [attempt for attempt in load.attempts if attempt.op != "create"]


def test_postgres_restart_under_load(stack: Stack) -> None:
    """PostgreSQL restarts (fast shutdown, down a moment, start): prompt 503s, then 2xx; no write lost."""
    load, result = run_fault(stack, "postgres restart", outage(stack.cluster, POSTGRES_DOWN))
    assert result.unavailable > 0, "PostgreSQL was restarted but no request noticed"
    assert result.from_proxy == 0, "the instances were up: only the app may answer 503"


def test_redis_stop_under_load(stack: Stack) -> None:
    """Redis dies, stays down a moment, comes back empty: the limiter falls back, nothing fails."""
    load, result = run_fault(stack, "redis stop", outage(stack.redis, REDIS_DOWN))
    assert result.ok == result.requests, "a Redis outage must not fail any request"


def test_worker_killed_under_load(stack: Stack) -> None:
    """kill -9 of one worker of one instance: its master replaces it; reads fail over, writes retry."""
    instance = stack.instances[0]
    killed = instance.wait_for_workers()[0]

    def fault() -> None:
        os.kill(killed, signal.SIGKILL)

    load, result = run_fault(stack, "kill -9 one worker", fault, kills=True)
    cut = {id(attempt) for attempt in cut_by_kill(load)}
    assert not [a for a in reads(load) if a.status != 200 and id(a) not in cut], (
        "a read failed while another instance was healthy (other than one cut short by the kill)"
    )
    assert killed not in instance.worker_pids()
    assert len(instance.wait_for_workers()) == 2, "the master did not replace the killed worker"


def test_master_stopped_under_load(stack: Stack) -> None:
    """SIGTERM to one instance's master: it drains and exits; the other serves everything."""
    instance = stack.instances[0]
    assert instance.process is not None

    def fault() -> None:
        os.kill(instance.pid, signal.SIGTERM)

    load, result = run_fault(stack, "SIGTERM one master", fault)
    try:
        instance.process.wait(timeout=STOPPED_WITHIN)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the instance still runs {STOPPED_WITHIN} s after its SIGTERM")
    assert not [attempt for attempt in reads(load) if attempt.status != 200], (
        "a read failed while another instance was healthy"
    )


def test_pgbouncer_restart_under_load(scaled: ScaledStack) -> None:
    """PgBouncer restarts (immediate shutdown, down a moment, start): prompt 503s, then 2xx; no write lost."""
    load, result = run_fault(scaled, "pgbouncer restart", outage(scaled.pgbouncer, POSTGRES_DOWN))
    assert result.unavailable > 0, "PgBouncer was restarted but no request noticed"
    assert result.from_proxy == 0, "the instances were up: only the app may answer 503"


def test_sentinel_failover_under_load(scaled: ScaledStack) -> None:
    """The Redis master killed: the limiter falls back, Sentinel promotes the replica; nothing fails.

    The last run on this stack: a restore() would start the killed master again, empty.
    """
    old_port = scaled.redis.port

    def fault() -> None:
        scaled.redis.stop()  # SIGKILL
        promoted = poll_until(
            scaled.sentinels[0].master_port_now,
            lambda port: port not in (None, old_port),
            within=30.0,
            interval=0.2,
        )
        assert promoted == scaled.replica.port, "Sentinel did not promote the replica"

    load, result = run_fault(scaled, "sentinel failover", fault)
    assert result.ok == result.requests, "a Redis failover must not fail any request"


def test_sustained_mixed_load(stack: Stack) -> None:
    """~30 s of creates, lists and gets across both instances: no 5xx, nothing else but 2xx."""
    stack.restore()
    assert stack.nginx is not None
    log_sizes = [len(instance.log_lines()) for instance in stack.instances]
    load = Load(stack.url, stack.key, label="sustained")
    load.start()
    started = time.monotonic()
    try:
        time.sleep(SUSTAINED)
    finally:
        load.stop()
    took = time.monotonic() - started
    result = summarize("sustained mixed load", load, started)
    RESULTS.append(result)

    latencies = sorted(attempt.elapsed for attempt in load.attempts)
    ops = Counter(attempt.op for attempt in load.attempts)
    by_upstream = Counter(
        upstream.split(", ")[-1]
        for upstream in served_upstreams(stack, [attempt.request_id for attempt in load.attempts])
    )
    print_table([result])
    print(
        f"{len(latencies)} requests in {took:.1f} s ({len(latencies) / took:.0f}/s), {dict(ops)}; "
        f"latency p50 {statistics.median(latencies) * 1000:.1f} ms, "
        f"p99 {latencies[int(len(latencies) * 0.99)] * 1000:.1f} ms, max {latencies[-1] * 1000:.1f} ms; "
        f"per instance {dict(by_upstream)}"
    )

    assert result.ok == result.requests, Counter(attempt.status for attempt in load.attempts)
    check_load(stack, load)
    assert len(by_upstream) == 2 and min(by_upstream.values()) >= result.requests // 4, by_upstream
    for instance, size in zip(stack.instances, log_sizes, strict=True):
        new = instance.log_lines()[size:]
        errors = [line for line in new if '"level": "error"' in line or "Traceback" in line]
        assert not errors, errors[:5]


def served_upstreams(stack: Stack, request_ids: list[str]) -> list[str]:
    """The upstream address nginx logged for each of these requests."""
    assert stack.nginx is not None
    return [entry["upstream"] for entry in stack.nginx.logged(request_ids).values()]
