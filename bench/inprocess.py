"""The per-request budget, in-process: CPU of direct WSGI calls, no server, no wrk.

Each app answers `GET /v1/pets?limit=20` from a werkzeug test environ, called straight through
WSGI in this thread; the CPU is this thread's (time.thread_time), so the pool's and Redis'
background threads and every other process are left out. The apps run side by side in
interleaved rounds and each keeps its best round (other processes only ever add to a round).
The differences between apps are the costs of the parts: the limiter on memory:// and
redis://, the request log, and everything of ours outside the SQL and the framework (the
service against the bare-Flask floor).
"""

from __future__ import annotations

import io
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from flask import Flask, Response
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio
from werkzeug.test import EnvironBuilder

from bench.flask_floor import create_flask_floor
from bench.measure import log
from petstore import create_app, logs, schemas, tracing, usage, web

PATH = "/v1/pets?limit=20"
# Each row: how its app is made (the service's settings, or the floor), and whether it logs.
Budget = dict[str, tuple[float, float]]  # name -> (CPU µs per request, wall µs per request)


@dataclass(frozen=True)
class Variant:
    """One app of the table."""

    name: str
    floor: bool
    storage: str  # "memory" or "redis"
    settings: tuple[tuple[str, Any], ...] = ()
    request_log: bool = True
    # Off: petstore.usage.count_request replaced by a no-op while this app answers.
    usage_counting: bool = True
    # The share of requests traced (petstore.tracing), None: off, as without OTEL_TRACES_EXPORTER.
    tracing: float | None = None


VARIANTS = (
    Variant("bare-Flask floor, memory://", True, "memory"),
    Variant("bare-Flask floor, redis://", True, "redis"),
    Variant("service, memory://", False, "memory"),
    Variant("service, redis://", False, "redis"),
    Variant("service without the limiter", False, "memory", (("RATELIMIT_ENABLED", False),)),
    Variant("service, memory://, request log off", False, "memory", request_log=False),
    Variant("service, memory://, usage counting off", False, "memory", usage_counting=False),
    Variant("service, memory://, tracing 1%", False, "memory", tracing=0.01),
    Variant("service, memory://, tracing 100%", False, "memory", tracing=1.0),
    Variant(
        "service, memory://, limits' MemoryStorage",
        False,
        "memory",
        (("RATELIMIT_TUNED_STORAGES", False),),
    ),
    Variant(
        "service, redis://, limits' RedisStorage",
        False,
        "redis",
        (("RATELIMIT_TUNED_STORAGES", False),),
    ),
)
# Derived costs: (what, minuend, subtrahend, target µs or None). The request log has no budget
# of its own: "ours outside SQL and framework" covers it (issue 20's decision).
COSTS: tuple[tuple[str, str, str, int | None], ...] = (
    ("limiter, memory://", "service, memory://", "service without the limiter", 80),
    ("limiter, redis://", "service, redis://", "service without the limiter", 200),
    ("request log", "service, memory://", "service, memory://, request log off", None),
    ("usage counting", "service, memory://", "service, memory://, usage counting off", 15),
    ("tracing at 1%", "service, memory://, tracing 1%", "service, memory://", 30),
    ("tracing at 100%", "service, memory://, tracing 100%", "service, memory://", 300),
    ("ours outside SQL and framework, memory://", "service, memory://", VARIANTS[0].name, 150),
    ("ours outside SQL and framework, redis://", "service, redis://", VARIANTS[1].name, 150),
)
VALIDATION_TARGET_US = 25
# Tracing off (the extra installed, no OTEL_TRACES_EXPORTER): its hooks alone, per request.
TRACING_OFF_TARGET_US = 5


def make_app(variant: Variant, database_url: str, redis_url: str) -> Flask:
    """The variant's app on the bench database."""
    storage = "memory://" if variant.storage == "memory" else redis_url
    settings = {"DATABASE_URL": database_url, "RATELIMIT_STORAGE_URI": storage}
    if variant.floor:
        return create_flask_floor(settings)
    return create_app({**settings, **dict(variant.settings)})


def close_app(app: Flask) -> None:
    """Close the pool an app opened."""
    for name in ("petstore.pool", "pool"):
        if name in app.extensions:
            app.extensions[name].close()


def caller(app: Flask, key: str) -> Callable[[], int]:
    """A function that answers PATH once through WSGI and returns the status."""
    environ = EnvironBuilder(path=PATH, headers=[("Authorization", f"Bearer {key}")]).get_environ()
    statuses: list[str] = []

    def write(data: bytes) -> None:
        """WSGI's write(), which no app here uses."""

    def start_response(
        status: str, headers: list[tuple[str, str]], exc_info: Any = None
    ) -> Callable[[bytes], object]:
        statuses.append(status)
        return write

    def call() -> int:
        statuses.clear()
        body: Iterable[bytes] = app(dict(environ, **{"wsgi.input": io.BytesIO()}), start_response)
        try:
            for _chunk in body:
                pass
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                close()
        return int(statuses[0].split()[0])

    return call


def interleaved_best(
    call: Callable[[], int],
    variants: Mapping[str, Callable[[], object]],
    requests: int,
    rounds: int,
) -> dict[str, float]:
    """Each variant's best round: this thread's CPU seconds for `requests` calls once its setter
    ran (and one call answered 200); rounds interleaved, the first one to warm up."""
    best = dict.fromkeys(variants, float("inf"))
    for round_number in range(rounds + 1):
        for name, use in variants.items():
            use()
            assert call() == 200
            started = time.thread_time()
            for _ in range(requests):
                call()
            if round_number:
                best[name] = min(best[name], time.thread_time() - started)
    return best


def request_log_to_null() -> logs.StdoutHandler:
    """The service's JSON log lines written, as under gunicorn (petstore.logs.StdoutHandler), but
    to /dev/null."""
    handler = logs.StdoutHandler(os.open(os.devnull, os.O_WRONLY))  # closed by the caller
    handler.setFormatter(logs.JSONFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    return handler


def no_counting(response: Response) -> None:
    """petstore.usage.count_request left out (the variant that measures its cost)."""


class EncodingExporter:
    """Encodes each batch as the OTLP/HTTP exporter does, and drops it; its CPU, summed."""

    def __init__(self) -> None:
        self.cpu = 0.0
        self.spans = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        started = time.thread_time()
        encode_spans(spans).SerializeToString()
        self.cpu += time.thread_time() - started
        self.spans += len(spans)
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

    def shutdown(self) -> None:
        """Nothing to close."""


def provider_sampling(ratio: float, exporter: EncodingExporter) -> Any:
    """The service's tracer provider, sampling `ratio` of new traces, exporting to `exporter`."""
    return tracing.make_provider(exporter, sampler=ParentBasedTraceIdRatio(ratio))


def hooks_off(database_url: str, calls: int, rounds: int) -> float:
    """CPU µs of the tracing hooks of one GET /v1/pets while tracing is off, best round."""
    tracing.use(None)
    app = create_app({"DATABASE_URL": database_url})

    @tracing.statement
    def statement() -> None:
        """A query function's hook, with no statement."""

    response = Response(status=200)
    try:
        best = float("inf")
        with app.test_request_context("/v1/pets"):
            for _ in range(rounds):
                started = time.thread_time()
                for _ in range(calls):
                    opened = tracing.start_request()
                    with tracing.span("auth.key_lookup"):
                        tracing.annotate("petstore.key_cache", "hit")
                    with tracing.span("ratelimit.count") as counting:
                        counting.is_recording()
                    statement()
                    tracing.current_ids()
                    tracing.finish_request(opened, response)
                best = min(best, time.thread_time() - started)
        return best / calls * 1e6
    finally:
        close_app(app)


def measure_budget(
    database_url: str, redis_url: str, key: str, requests: int, rounds: int
) -> tuple[Budget, dict[str, float], float]:
    """CPU and wall µs per request of each variant (best round), validation µs per query, and
    the tracing hooks' µs per request while tracing is off."""
    handler = request_log_to_null()
    root = logging.getLogger()
    counting = usage.count_request
    apps = {variant: make_app(variant, database_url, redis_url) for variant in VARIANTS}
    providers = {
        variant: provider_sampling(variant.tracing, EncodingExporter())
        for variant in VARIANTS
        if variant.tracing is not None
    }
    timings: dict[str, list[tuple[float, float]]] = {variant.name: [] for variant in VARIANTS}
    try:
        calls = {variant: caller(app, key) for variant, app in apps.items()}
        for round_number in range(rounds + 1):
            for variant, call in calls.items():
                root.setLevel(logging.INFO if variant.request_log else logging.WARNING)
                usage.count_request = counting if variant.usage_counting else no_counting
                tracing.use(providers.get(variant))
                status = call()
                assert status == 200, f"{variant.name}: {status}"
                cpu, wall = time.thread_time(), time.perf_counter()
                for _ in range(requests):
                    call()
                cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
                if round_number:  # the first round warms up: pool, prepared statements
                    timings[variant.name].append((cpu, wall))
    finally:
        usage.count_request = counting
        tracing.use(None)
        for app in apps.values():
            close_app(app)
        root.setLevel(logging.WARNING)
        handler.close()
        os.close(handler.fd)
    # The best round, as timeit takes: background load only ever adds to a round's time.
    budget = {
        name: (
            min(cpu for cpu, _wall in rounds_) / requests * 1e6,
            min(wall for _cpu, wall in rounds_) / requests * 1e6,
        )
        for name, rounds_ in timings.items()
    }
    return (
        budget,
        measure_validation(requests * 4),
        hooks_off(database_url, requests * 20, 3),
    )


def validation_queries(cursor: int) -> dict[str, dict[str, str]]:
    """The query strings of the list scenarios, as request.args.to_dict() gives them."""
    return {
        "limit=20": {"limit": "20"},
        "limit=100&status=available": {"limit": "100", "status": "available"},
        f"limit=20&after={cursor}": {"limit": "20", "after": str(cursor)},
    }


def measure_validation(calls: int, cursor: int = 4980) -> dict[str, float]:
    """µs of CPU per petstore.web.validate(list_pets_query, ...) call, per query string."""
    result = {}
    for name, query in validation_queries(cursor).items():
        web.validate(schemas.list_pets_query, dict(query))
        best = float("inf")
        for _round in range(3):  # the best of three: validation is pure CPU
            cpu = time.thread_time()
            for _ in range(calls):
                web.validate(schemas.list_pets_query, dict(query))
            best = min(best, time.thread_time() - cpu)
        result[name] = best / calls * 1e6
    return result


def budget_table(
    budget: Budget, validation: dict[str, float], tracing_off: float, requests: int, rounds: int
) -> str:
    """The table in Markdown (printed to stdout as it is)."""
    lines = [
        f"In-process `GET {PATH}`: direct WSGI calls, {rounds} interleaved rounds of {requests} "
        "per app after one to warm up, the best round (background load only adds); CPU of the "
        "calling thread.",
        "",
        "| app | CPU µs/request | wall µs/request |",
        "|---|---:|---:|",
        *(f"| {name} | {cpu:,.0f} | {wall:,.0f} |" for name, (cpu, wall) in budget.items()),
        "",
        "| cost | CPU µs/request | target | met |",
        "|---|---:|---:|---|",
    ]
    for what, whole, without, target in COSTS:
        cost = budget[whole][0] - budget[without][0]
        if target is None:
            lines.append(f"| {what} ({whole} − {without}) | {cost:+,.0f} | none | n/a |")
            continue
        met = "yes" if cost <= target else "no"
        lines.append(f"| {what} ({whole} − {without}) | {cost:+,.0f} | ≤ {target} | {met} |")
    for name, us in validation.items():
        met = "yes" if us <= VALIDATION_TARGET_US else "no"
        lines.append(
            f"| validation of `{name}` (petstore.web.validate, per call) | {us:,.1f} "
            f"| ≤ {VALIDATION_TARGET_US} | {met} |"
        )
    met = "yes" if tracing_off <= TRACING_OFF_TARGET_US else "no"
    lines.append(
        "| tracing off, the extra installed (petstore.tracing's hooks of one request, "
        f"alone) | {tracing_off:,.1f} | ≤ {TRACING_OFF_TARGET_US} | {met} |"
    )
    return "\n".join(lines)


def budget(redis_url: str, database_url: str, key: str, requests: int, rounds: int) -> str:
    """The in-process per-request budget table: `rounds` of `requests` calls per app."""
    log(f"in-process budget: {rounds} rounds of {requests} direct WSGI calls per app")
    redis.Redis.from_url(redis_url, socket_timeout=5).flushdb()
    found, validation, tracing_off = measure_budget(database_url, redis_url, key, requests, rounds)
    return budget_table(found, validation, tracing_off, requests, rounds)
