"""Prometheus metrics: what the service counts, per request and per worker, and how /metrics reads it.

Under gunicorn every worker is a process of its own, so prometheus_client runs in its multiprocess
mode: each worker writes its numbers to files in PROMETHEUS_MULTIPROC_DIR and the worker that
answers a scrape sums every worker's files (deploy/gunicorn.conf.py empties the directory at
start and drops a dead worker's gauges). Without that setting the numbers are this process's
own, which is right for one process (the tests, a single worker).

Label values come from fixed sets only: operation ids, HTTP statuses, Error codes. Never a path,
a key or anything else a client chooses.
"""

from __future__ import annotations

import atexit
import bisect
import importlib.metadata
import os
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields

import psycopg
import psycopg_pool
from flask import Flask, Response, current_app, g, request
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
    values,
)
from prometheus_client.multiprocess import MultiProcessCollector

from petstore import periodic, tracing
from petstore.config import ConfigError
from petstore.durable import CommitNotReplicated

EXTENSION = "petstore.metrics"

# Requests are counted by operation: the operationId of an API operation's route (init_app is given
# them, from the views' OpenAPI descriptions: petstore.views.operation_ids), else a name of our
# own for these endpoints, which the document does not describe. Anything else, unrouted requests
# (404, 405) included, is "unknown".
OTHER_ENDPOINTS: dict[str, str] = {
    "docs.openapi_json": "openapi",
    "docs.docs_page": "docs",
    "docs.docs_asset": "docsAsset",
    "health.healthz": "healthz",
    "health.readyz": "readyz",
    "metrics.scrape": "metrics",
}
UNKNOWN = "unknown"

# The codes of a 429 (petstore/ratelimit/budgets.py, bans.py); any other body would be counted as "other".
TOO_MANY_REQUESTS_CODES = frozenset({"rate_limited", "api_key_banned"})

# Seconds. The service answers in 1 to 50 ms when healthy, so that range gets most bounds;
# the rest catch pool waits (2 s), statement timeouts (5 s) and worse.
LATENCY_BUCKETS = (
    0.001,
    0.002,
    0.003,
    0.004,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)

# How often each worker writes its pool and limiter gauges (see sample_while_open).
SAMPLE_SECONDS = 1.0

# Each worker's own process numbers, one series per live worker labelled by its pid ("liveall"):
# multiprocess mode leaves out prometheus_client's ProcessCollector, which would report the worker
# that answers a scrape only (and reads /proc/stat, which the systemd unit's ProcSubset=pid hides).
PROCESS_GAUGES = {
    "cpu": ("petstore_worker_cpu_seconds", "CPU time (user and system) the worker has used."),
    "rss": ("petstore_worker_resident_memory_bytes", "The worker's resident memory."),
    "fds": ("petstore_worker_open_fds", "File descriptors the worker has open."),
}

# psycopg's "database unavailable" errors -> a fixed label, the most specific first.
DATABASE_ERROR_KINDS: tuple[tuple[type[Exception], str], ...] = (
    (CommitNotReplicated, "commit_not_replicated"),
    (psycopg_pool.PoolTimeout, "pool_timeout"),
    (psycopg.errors.QueryCanceled, "statement_timeout"),
    (psycopg.errors.ReadOnlySqlTransaction, "read_only"),
    (psycopg.InternalError, "lost_answer"),
    (psycopg.InterfaceError, "interface"),
    (psycopg.OperationalError, "operational"),
)


def multiprocess_mode() -> bool:
    """Whether prometheus_client writes to PROMETHEUS_MULTIPROC_DIR (decided when it was imported)."""
    return bool(getattr(values.ValueClass, "_multiprocess", False))


class Tally:
    """This process's requests and latencies not yet written to prometheus_client.

    In multiprocess mode every prometheus_client update is a locked write to a memory-mapped
    file with a getpid() system call: three per request (a count, a bucket, a sum) cost about
    25 µs of CPU on the benchmark machine. Here a request costs a lock and two dict updates;
    flush() writes the totals, by the sampler every SAMPLE_SECONDS, at each scrape and at exit.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # (endpoint, status) -> requests
        self.requests: dict[tuple[str | None, int], int] = {}
        # endpoint -> [observations in each bucket of LATENCY_BUCKETS, then +Inf, then the sum]
        self.latency: dict[str | None, list[float]] = {}

    def add(self, endpoint: str | None, status: int, seconds: float | None) -> None:
        """One request (its latency, when known)."""
        key = (endpoint, status)
        with self.lock:
            self.requests[key] = self.requests.get(key, 0) + 1
            if seconds is None:
                return
            slots = self.latency.get(endpoint)
            if slots is None:
                slots = self.latency[endpoint] = [0.0] * (len(LATENCY_BUCKETS) + 2)
            # The first bound at or above the value: "le" means less than or equal.
            slots[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
            slots[-1] += seconds

    def take(
        self,
    ) -> tuple[dict[tuple[str | None, int], int], dict[str | None, list[float]]]:
        """Everything tallied so far, leaving the tally empty."""
        with self.lock:
            taken = self.requests, self.latency
            self.requests, self.latency = {}, {}
        return taken


@dataclass
class Metrics:
    """One app's metric objects and the tally of requests not yet written to them."""

    requests: Counter
    latency: Histogram
    plan_requests: Counter
    too_many_requests: Counter
    bans_created: Counter
    idempotent_replays: Counter
    database_errors: Counter
    ratelimit_storage_errors: Counter
    ratelimit_fallback: Gauge
    pool_size: Gauge
    pool_in_use: Gauge
    pool_waiting: Gauge
    statement_timeout_unpinned: Gauge
    build_info: Gauge
    # PROCESS_GAUGES' keys -> the gauge.
    process: dict[str, Gauge]
    registry: CollectorRegistry
    # Flask endpoint -> the operation its requests are counted by (any other: UNKNOWN).
    operations: dict[str, str]
    tally: Tally = field(default_factory=Tally)

    def operation(self, endpoint: str | None) -> str:
        """The operation a request to `endpoint` is counted by."""
        return UNKNOWN if endpoint is None else self.operations.get(endpoint, UNKNOWN)

    def flush(self) -> None:
        """Write the tallied requests and latencies to prometheus_client."""
        requests, latency = self.tally.take()
        for (endpoint, status), count in requests.items():
            operation = self.operation(endpoint)
            self.requests.labels(operation=operation, status=str(status)).inc(count)
        for endpoint, slots in latency.items():
            histogram = self.latency.labels(operation=self.operation(endpoint))
            # Histogram.observe() takes one value at a time; its bucket counters and sum take
            # any amount (prometheus_client keeps a bucket's own count and adds them up when read).
            # Private attributes of the pinned prometheus-client: tests/app/test_metrics.py checks
            # that a flush reads exactly as the same observe() calls would.
            for bucket, observed in zip(histogram._buckets, slots[:-1], strict=True):
                if observed:
                    bucket.inc(observed)
            histogram._sum.inc(slots[-1])

    def all(self) -> Iterator[Counter | Gauge | Histogram]:
        """Every metric object, to register in a one-process registry: the fields', in order."""
        for each in fields(self):
            metric = getattr(self, each.name)
            if isinstance(metric, Counter | Gauge | Histogram):
                yield metric
        yield tracing.SPANS_DROPPED
        yield from self.process.values()


def build(operation_ids: Mapping[str, str]) -> Metrics:
    """The metric objects, not registered anywhere (init_app decides how a scrape reads them);
    requests counted by `operation_ids` (Flask endpoint -> operationId) and OTHER_ENDPOINTS.

    Gauges are per worker and summed over the live ones ("livesum"): a dead worker's files are
    dropped by gunicorn's child_exit hook, so its last pool numbers do not linger in the sum.
    """
    metrics = Metrics(
        requests=Counter(
            "petstore_http_requests",
            "Requests answered, by operation id and HTTP status.",
            ["operation", "status"],
            registry=None,
        ),
        latency=Histogram(
            "petstore_http_request_duration_seconds",
            "Time from the first request hook to the response, by operation id.",
            ["operation"],
            buckets=LATENCY_BUCKETS,
            registry=None,
        ),
        plan_requests=Counter(
            "petstore_plan_requests",
            "API requests by the plan of their key (none: without a valid key) and outcome: 2xx "
            "(any status below 400), 4xx (but 429), 429, 5xx. Written with the usage counts "
            "(petstore.usage), every PETSTORE_USAGE_FLUSH_SECONDS.",
            ["plan", "outcome"],
            registry=None,
        ),
        too_many_requests=Counter(
            "petstore_too_many_requests",
            "429 answers by Error code: rate_limited (budget spent) or api_key_banned.",
            ["code"],
            registry=None,
        ),
        bans_created=Counter(
            "petstore_bans_created", "Keys banned for calling on after 429s.", registry=None
        ),
        idempotent_replays=Counter(
            "petstore_idempotent_replays",
            "createPet answers replayed for a repeated Idempotency-Key.",
            registry=None,
        ),
        database_errors=Counter(
            "petstore_database_errors",
            "Requests answered 503 because PostgreSQL was unavailable, by kind of error.",
            ["kind"],
            registry=None,
        ),
        ratelimit_storage_errors=Counter(
            "petstore_ratelimit_storage_errors",
            "Failures of the rate limit storage (Redis) that sent a worker's limiter to its "
            "in-memory fallback.",
            registry=None,
        ),
        ratelimit_fallback=Gauge(
            "petstore_ratelimit_storage_fallback",
            "Workers whose limiter counts in memory because its storage (Redis) failed.",
            registry=None,
            multiprocess_mode="livesum",
        ),
        pool_size=Gauge(
            "petstore_db_pool_size",
            "PostgreSQL connections the workers' pools hold (in use or idle).",
            registry=None,
            multiprocess_mode="livesum",
        ),
        pool_in_use=Gauge(
            "petstore_db_pool_connections_in_use",
            "PostgreSQL connections lent to requests (or being opened) right now.",
            registry=None,
            multiprocess_mode="livesum",
        ),
        pool_waiting=Gauge(
            "petstore_db_pool_requests_waiting",
            "Requests waiting for a PostgreSQL connection right now.",
            registry=None,
            multiprocess_mode="livesum",
        ),
        statement_timeout_unpinned=Gauge(
            "petstore_db_statement_timeout_unpinned",
            "Workers whose last new PostgreSQL connection found a statement_timeout other than "
            "PETSTORE_DB_STATEMENT_TIMEOUT_MS (behind a pooler: run `petstore db upgrade`).",
            registry=None,
            multiprocess_mode="livesum",
        ),
        build_info=Gauge(
            "petstore_build_info",
            "Always 1: the service version and the sunset date of getPet, as labels.",
            ["version", "getpet_sunset"],
            registry=None,
            multiprocess_mode="livemax",
        ),
        process={
            key: Gauge(name, text, registry=None, multiprocess_mode="liveall")
            for key, (name, text) in PROCESS_GAUGES.items()
        },
        # Not auto_describe: registering the multiprocess collector would read every worker's
        # file, and fail on the empty one a worker booting beside it has just created.
        registry=CollectorRegistry(),
        operations={**operation_ids, **OTHER_ENDPOINTS},
    )
    # Known series start at zero, so that rate() and increase() see their first increment.
    for operation in sorted({*metrics.operations.values(), UNKNOWN}):
        metrics.latency.labels(operation=operation)
    for code in sorted(TOO_MANY_REQUESTS_CODES):
        metrics.too_many_requests.labels(code=code)
    for _error, kind in DATABASE_ERROR_KINDS:
        metrics.database_errors.labels(kind=kind)
    for reason in tracing.DROP_REASONS:
        tracing.SPANS_DROPPED.labels(reason=reason)
    return metrics


def get_metrics() -> Metrics:
    """The metrics of the current app."""
    metrics: Metrics = current_app.extensions[EXTENSION]
    return metrics


def observe_request(response: Response, limited_code: str | None = None) -> Response:
    """Count the request and its latency by operation and status; note a 429's code, the one
    the pipeline refused it with (`limited_code`: rate_limited or api_key_banned).

    The one per-request call (petstore.pipeline.after_view): it reads what the request left
    (its endpoint, g.started from petstore.logs.start_request) and the response, and changes
    neither. It only tallies
    (see Tally): a few µs.
    """
    metrics: Metrics = current_app.extensions[EXTENSION]
    status = response.status_code
    started = g.get("started")
    metrics.tally.add(
        request.endpoint, status, None if started is None else time.perf_counter() - started
    )
    if status == 429:
        code = limited_code if limited_code in TOO_MANY_REQUESTS_CODES else "other"
        metrics.too_many_requests.labels(code=code).inc()
    return response


def requests_by_plan(totals: Mapping[tuple[str, str], int], app: Flask | None = None) -> None:
    """Add requests by (plan, outcome), labels from petstore.usage's fixed sets (a batch of
    its counts, or zeros to start the series)."""
    metrics: Metrics = (app or current_app).extensions[EXTENSION]
    for (plan, outcome), requests in totals.items():
        metrics.plan_requests.labels(plan=plan, outcome=outcome).inc(requests)


def idempotent_replayed() -> None:
    """A POST was answered with the stored response of its Idempotency-Key (petstore.idempotency)."""
    get_metrics().idempotent_replays.inc()


def ban_created() -> None:
    """A key was banned (petstore.ratelimit.bans.strike)."""
    get_metrics().bans_created.inc()


def database_unavailable(error: BaseException) -> None:
    """A request failed because PostgreSQL was unavailable (petstore.errors)."""
    kind = next((name for cls, name in DATABASE_ERROR_KINDS if isinstance(error, cls)), "other")
    get_metrics().database_errors.labels(kind=kind).inc()


def ratelimit_storage_failed() -> None:
    """The limiter's storage failed; this worker now counts in memory (ratelimit.limiter.PlanLimiter.count)."""
    get_metrics().ratelimit_storage_errors.inc()


def process_numbers() -> dict[str, float]:
    """This process's CPU seconds, and on Linux its resident bytes and open descriptors (PROCESS_GAUGES)."""
    numbers = {"cpu": time.process_time()}
    try:
        with open("/proc/self/statm", "rb") as statm:
            numbers["rss"] = int(statm.read().split()[1]) * os.sysconf("SC_PAGESIZE")
        numbers["fds"] = len(os.listdir("/proc/self/fd"))
    except OSError:
        pass
    return numbers


def sample(app: Flask) -> None:
    """Write this worker's tally and gauges: its pool's size, connections in use, waiting requests,
    an unpinned statement timeout, the limiter's fallback, its CPU, memory and descriptors."""
    metrics: Metrics = app.extensions[EXTENSION]
    metrics.flush()
    for key, value in process_numbers().items():
        metrics.process[key].set(value)
    pool = app.extensions.get("petstore.pool")
    if pool is not None and not pool.closed:
        stats = pool.get_stats()
        metrics.pool_size.set(stats["pool_size"])
        metrics.pool_in_use.set(stats["pool_size"] - stats["pool_available"])
        metrics.pool_waiting.set(stats.get("requests_waiting", 0))
    pin = app.extensions.get("petstore.timeout_pin")
    metrics.statement_timeout_unpinned.set(0 if pin is None or pin.found_ms is None else 1)
    limiter = app.extensions.get("petstore.limiter")
    metrics.ratelimit_fallback.set(1 if limiter is not None and limiter.storage_dead else 0)


def sample_while_open(app: Flask) -> bool:
    """The sampler's step, every SAMPLE_SECONDS until the app's pool is closed: `sample`.

    In multiprocess mode a scrape is answered by one worker, which reads every worker's files:
    sampling at scrape time would refresh only the answering worker's numbers, and the others'
    would stay as they were at their last scrape. Sampling on each request would cost every
    request, count the request's own connection as in use, and leave an idle worker's numbers
    stale. So each worker samples itself, off the request path: a scrape sees numbers at most
    SAMPLE_SECONDS old.
    """
    pool = app.extensions.get("petstore.pool")
    if pool is not None and pool.closed:
        return False
    sample(app)
    return True


def metrics_response() -> Response:
    """The Prometheus text format of every worker's numbers (or this process's)."""
    app = current_app._get_current_object()  # type: ignore[attr-defined]
    metrics: Metrics = app.extensions[EXTENSION]
    # This worker's own numbers are fresh at least; the others' are at most SAMPLE_SECONDS old.
    sample(app)
    return current_app.response_class(
        generate_latest(metrics.registry), mimetype=None, content_type=CONTENT_TYPE_LATEST
    )


def init_app(app: Flask, operation_ids: Mapping[str, str]) -> None:
    """Create the app's metrics, the registry a scrape reads and, with several workers, a sampler;
    requests counted by `operation_ids` (Flask endpoint -> operationId, petstore.views)."""
    directory = app.config["METRICS_DIR"]
    metrics = build(operation_ids)
    if directory:
        if not multiprocess_mode():
            # config.check saw the variable set: prometheus_client was imported before it was.
            raise ConfigError(
                "PROMETHEUS_MULTIPROC_DIR was set after prometheus_client was imported: set it "
                "in the environment of the service, before it starts"
            )
        # deploy/gunicorn.conf.py makes it (and empties it) before the workers start.
        os.makedirs(directory, exist_ok=True)
        MultiProcessCollector(metrics.registry, path=directory)  # type: ignore[no-untyped-call]
    else:
        # The _created series exist in one-process mode only; leave them out so both read alike.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        for metric in metrics.all():
            metrics.registry.register(metric)
    sunset = time.strftime("%Y-%m-%d", time.gmtime(app.config["SUNSET"]))
    metrics.build_info.labels(
        version=importlib.metadata.version("petstore"), getpet_sunset=sunset
    ).set(1)
    app.extensions[EXTENSION] = metrics
    if directory:
        periodic.every(
            SAMPLE_SECONDS,
            app,
            sample_while_open,
            "petstore-metrics-sampler",
            "cannot sample the pool and limiter gauges",
        )
        # A worker that stops (SIGTERM, max_requests) writes its last second; a killed one loses it.
        atexit.register(metrics.flush)
