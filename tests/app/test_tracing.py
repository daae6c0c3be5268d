"""Traces (petstore.tracing), with the SDK's in-memory exporter: each operation's span tree, no
secrets in any attribute, an incoming traceparent continued and a malformed one ignored, the
trace ids in the log lines, the drops counted, and nothing of opentelemetry loaded while off."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from flask import Flask
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import StatusCode
from prometheus_client.parser import text_string_to_metric_families

from petstore import db, logs, tracing
from tests.support.servers import free_port

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Every span of the test, ended, in the order they ended; tracing off again afterwards."""
    exporter = InMemorySpanExporter()
    made = TracerProvider()
    made.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use(made)
    yield exporter
    tracing.use(None)


def tree(finished: Sequence[ReadableSpan]) -> list[str]:
    """The spans as an indented outline, children in the order they started."""
    children: dict[int | None, list[ReadableSpan]] = {}
    ids = {span.context.span_id for span in finished}
    for span in sorted(finished, key=lambda span: span.start_time or 0):
        parent = span.parent.span_id if span.parent and span.parent.span_id in ids else None
        children.setdefault(parent, []).append(span)
    lines: list[str] = []

    def walk(parent: int | None, depth: int) -> None:
        for span in children.get(parent, []):
            lines.append("  " * depth + span.name)
            walk(span.context.span_id, depth + 1)

    walk(None, 0)
    return lines


NEW_PET = {"name": "Rex", "categoryId": 1, "status": "available"}
# (method, path, body, extra headers) -> the span tree of its first request with a new key.
OPERATIONS: dict[str, tuple[str, str, Any, dict[str, str], list[str]]] = {
    "listPets": (
        "GET",
        "/v1/pets?limit=5",
        None,
        {},
        [
            "GET /v1/pets",
            "  auth.key_lookup",
            "    keys.find_key_by_hash",
            "  ratelimit.count",
            "  pets.list_pets",
        ],
    ),
    "listPets by status": (
        "GET",
        "/v1/pets?status=sold",
        None,
        {},
        [
            "GET /v1/pets",
            "  auth.key_lookup",
            "    keys.find_key_by_hash",
            "  ratelimit.count",
            "  pets.list_pets_by_status",
        ],
    ),
    "createPet": (
        "POST",
        "/v1/pets",
        NEW_PET,
        {},
        [
            "POST /v1/pets",
            "  auth.key_lookup",
            "    keys.find_key_by_hash",
            "  ratelimit.count",
            "  durable.write",
            "    pets.insert_pet",
        ],
    ),
    "createPet, Idempotency-Key": (
        "POST",
        "/v1/pets",
        NEW_PET,
        {"Idempotency-Key": "trace-me-1"},
        [
            "POST /v1/pets",
            "  auth.key_lookup",
            "    keys.find_key_by_hash",
            "  ratelimit.count",
            "  durable.write",
            "    idempotency.find_response",
            "    pets.insert_pet",
            "    idempotency.claim",
        ],
    ),
    "getPet": (
        "GET",
        "/v1/pets/1",
        None,
        {},
        [
            "GET /v1/pets/<pet_id>",
            "  auth.key_lookup",
            "    keys.find_key_by_hash",
            "  ratelimit.count",
            "  pets.find_pet",
        ],
    ),
    "getRateLimit": (
        "GET",
        "/v1/rate_limit",
        None,
        {},
        ["GET /v1/rate_limit", "  auth.key_lookup", "    keys.find_key_by_hash"],
    ),
    "listOrders": (
        "GET",
        "/v1/store/orders",
        None,
        {},
        [
            "GET /v1/store/orders",
            "  auth.key_lookup",
            "    keys.find_key_by_hash",
            "  ratelimit.count",
        ],
    ),
    "getUsage": (
        "GET",
        "/v1/usage",
        None,
        {},
        [
            "GET /v1/usage",
            "  auth.key_lookup",
            "    keys.find_key_by_hash",
            "  ratelimit.count",
            "  usage.usage_of_key",
        ],
    ),
    "unknown path": (
        "GET",
        "/v1/nothing",
        None,
        {},
        ["GET", "  auth.key_lookup", "    keys.find_key_by_hash", "  ratelimit.count"],
    ),
}


@pytest.mark.parametrize("operation", OPERATIONS)
def test_each_operation_has_its_span_tree(
    operation: str,
    make_app: Callable[..., Flask],
    auth_headers: dict[str, str],
    spans: InMemorySpanExporter,
) -> None:
    method, path, body, headers, expected = OPERATIONS[operation]
    client = make_app().test_client()
    response = client.open(path, method=method, json=body, headers={**auth_headers, **headers})
    assert response.status_code in (200, 201, 404, 501)  # listOrders: not implemented
    assert tree(spans.get_finished_spans()) == expected
    (server,) = [span for span in spans.get_finished_spans() if span.parent is None]
    assert server.attributes is not None
    assert server.attributes["http.response.status_code"] == response.status_code
    assert server.attributes["http.request.method"] == method


def test_probes_and_scrapes_are_not_traced(client: Any, spans: InMemorySpanExporter) -> None:
    for path in ("/healthz", "/readyz", "/metrics"):
        assert client.get(path).status_code in (200, 503)
    assert spans.get_finished_spans() == ()
    assert client.get("/v1/pets").status_code == 401
    assert tree(spans.get_finished_spans()) == ["GET /v1/pets", "  ratelimit.count"]


def test_the_key_lookup_says_hit_or_miss(
    make_app: Callable[..., Flask], auth_headers: dict[str, str], spans: InMemorySpanExporter
) -> None:
    client = make_app(KEY_CACHE_SECONDS=60).test_client()
    for _ in range(2):
        assert client.get("/v1/pets", headers=auth_headers).status_code == 200
    lookups = [span for span in spans.get_finished_spans() if span.name == "auth.key_lookup"]
    assert [(span.attributes or {})["petstore.key_cache"] for span in lookups] == ["miss", "hit"]


def outcomes(finished: Sequence[ReadableSpan]) -> list[Any]:
    return [
        (span.attributes or {}).get("petstore.ratelimit.outcome")
        for span in finished
        if span.name == "ratelimit.count"
    ]


def test_the_count_says_its_outcome(
    make_app: Callable[..., Flask], issue_key: Callable[..., str], spans: InMemorySpanExporter
) -> None:
    key = issue_key("free", per_minute=1, per_day=100)
    client = make_app(BAN_THRESHOLD=1, BAN_SECONDS=60).test_client()
    headers = {"Authorization": f"Bearer {key}"}
    statuses = [client.get("/v1/pets", headers=headers).status_code for _ in range(3)]
    assert statuses == [200, 429, 429]
    assert outcomes(spans.get_finished_spans()) == ["counted", "refused", "banned"]
    # The key read again, the strike and the ban are the refused count's.
    refused = [span for span in spans.get_finished_spans() if span.name == "ratelimit.count"][1]
    trace_id = refused.context.trace_id
    assert tree(
        [span for span in spans.get_finished_spans() if span.context.trace_id == trace_id]
    ) == [
        "GET /v1/pets",
        "  auth.key_lookup",
        "  ratelimit.count",
        "    keys.find_key_by_hash",
        "    durable.write",
        "      bans.insert_ban",
    ]


def test_a_count_in_the_fallback_says_so(
    make_app: Callable[..., Flask], auth_headers: dict[str, str], spans: InMemorySpanExporter
) -> None:
    client = make_app(RATELIMIT_STORAGE_URI="redis://127.0.0.1:9/0").test_client()
    assert client.get("/v1/pets", headers=auth_headers).status_code == 200
    assert outcomes(spans.get_finished_spans()) == ["fallback"]


def test_no_attribute_carries_a_secret(
    make_app: Callable[..., Flask], api_key: str, spans: InMemorySpanExporter
) -> None:
    client = make_app().test_client()
    headers = {"Authorization": f"Bearer {api_key}", "Idempotency-Key": "secretive-retry"}
    pet = {"name": "Secret Squirrel", "categoryId": 77, "status": "pending"}
    assert client.post("/v1/pets", json=pet, headers=headers).status_code == 201
    assert client.get("/v1/pets?limit=1&after=0", headers=headers).status_code == 200
    assert client.get("/v1/pets", headers={"Authorization": "Bearer wrong"}).status_code == 401
    finished = spans.get_finished_spans()
    assert len(finished) >= 10
    said = json.dumps(
        [
            {**(span.attributes or {}), "name": span.name, "status": span.status.description}
            for span in finished
        ]
    )
    for secret in (api_key, api_key[-8:], "Bearer", "Secret Squirrel", "secretive-retry", "77"):
        assert secret not in said
    assert "authorization" not in said.lower()


def test_an_incoming_traceparent_is_continued(
    client: Any, auth_headers: dict[str, str], spans: InMemorySpanExporter
) -> None:
    parent = f"00-{TRACE_ID}-{PARENT_ID}-01"
    assert (
        client.get("/v1/pets", headers={**auth_headers, "traceparent": parent}).status_code == 200
    )
    finished = spans.get_finished_spans()
    assert {f"{span.context.trace_id:032x}" for span in finished} == {TRACE_ID}
    (server,) = [span for span in finished if span.name == "GET /v1/pets"]
    assert server.parent is not None and server.parent.is_remote
    assert f"{server.parent.span_id:016x}" == PARENT_ID


@pytest.mark.parametrize(
    "traceparent",
    [
        "garbage",
        f"00-{TRACE_ID}-{PARENT_ID}",
        f"00-{'0' * 32}-{PARENT_ID}-01",  # an all-zero trace id
        f"00-{TRACE_ID}-{'0' * 16}-01",
        f"ff-{TRACE_ID}-{PARENT_ID}-01",  # the forbidden version
        f"00-{TRACE_ID.upper()}-{PARENT_ID}-01",
        "00-" + "x" * 200,
    ],
)
def test_a_malformed_traceparent_starts_a_new_trace(
    traceparent: str, client: Any, auth_headers: dict[str, str], spans: InMemorySpanExporter
) -> None:
    headers = {**auth_headers, "traceparent": traceparent}
    assert client.get("/v1/pets", headers=headers).status_code == 200
    (server,) = [span for span in spans.get_finished_spans() if span.name == "GET /v1/pets"]
    assert server.parent is None
    assert f"{server.context.trace_id:032x}" != TRACE_ID


def test_a_caller_that_did_not_sample_gets_no_spans(
    client: Any, auth_headers: dict[str, str], spans: InMemorySpanExporter
) -> None:
    headers = {**auth_headers, "traceparent": f"00-{TRACE_ID}-{PARENT_ID}-00"}
    assert client.get("/v1/pets", headers=headers).status_code == 200
    assert spans.get_finished_spans() == ()


def test_a_failure_is_its_type_alone(
    make_app: Callable[..., Flask], auth_headers: dict[str, str], spans: InMemorySpanExporter
) -> None:
    nowhere = f"postgresql://postgres@127.0.0.1:{free_port()}/petstore"
    client = make_app(DATABASE_URL=nowhere, DB_POOL_TIMEOUT=0.2).test_client()
    assert client.get("/v1/pets", headers=auth_headers).status_code == 503
    by_name = {span.name: span for span in spans.get_finished_spans()}
    assert set(by_name) == {"GET /v1/pets", "auth.key_lookup"}
    lookup, server = by_name["auth.key_lookup"], by_name["GET /v1/pets"]
    assert (lookup.attributes or {})["error.type"] == "PoolTimeout"
    assert lookup.status.status_code is StatusCode.ERROR
    assert lookup.status.description is None and lookup.events == ()
    assert server.status.status_code is StatusCode.ERROR
    assert (server.attributes or {})["http.response.status_code"] == 503


class Lines(logging.Handler):
    """The JSON lines the service's formatter makes, kept."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logs.JSONFormatter())
        self.lines: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(self.format(record)))


@pytest.fixture
def log_lines() -> Iterator[Lines]:
    handler = Lines()
    logs.log.addHandler(handler)
    logs.log.setLevel(logging.INFO)
    yield handler
    logs.log.removeHandler(handler)
    logs.log.setLevel(logging.NOTSET)


def test_log_lines_carry_the_trace_ids(
    client: Any, auth_headers: dict[str, str], spans: InMemorySpanExporter, log_lines: Lines
) -> None:
    assert client.get("/v1/pets", headers=auth_headers).status_code == 200
    (server,) = [span for span in spans.get_finished_spans() if span.parent is None]
    (line,) = log_lines.lines
    assert line["trace_id"] == f"{server.context.trace_id:032x}"
    assert line["span_id"] == f"{server.context.span_id:016x}"
    assert line["request_id"]


def test_without_a_recording_span_log_lines_have_no_trace_ids(
    client: Any, auth_headers: dict[str, str], log_lines: Lines
) -> None:
    unsampled = TracerProvider(sampler=ALWAYS_OFF)
    exporter = InMemorySpanExporter()
    unsampled.add_span_processor(SimpleSpanProcessor(exporter))
    for provider in (None, unsampled):
        tracing.use(provider)
        try:
            assert client.get("/v1/pets", headers=auth_headers).status_code == 200
        finally:
            tracing.use(None)
    assert [("trace_id" in line, "span_id" in line) for line in log_lines.lines] == [
        (False, False),
        (False, False),
    ]
    assert exporter.get_finished_spans() == ()


def test_off_imports_no_opentelemetry(database_url: str) -> None:
    """With OTEL_TRACES_EXPORTER unset, a worker that answers requests never loads the SDK."""
    program = (
        "import sys\n"
        "from petstore import create_app, tracing\n"
        "tracing.start()\n"
        f"app = create_app({{'DATABASE_URL': {database_url!r}}})\n"
        "client = app.test_client()\n"
        "assert client.get('/v1/pets').status_code == 401\n"
        "assert client.get('/healthz').status_code in (200, 503)\n"
        "print(sorted(name for name in sys.modules if name.startswith('opentelemetry')))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PROMETHEUS_"))}
    done = subprocess.run(
        [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize(
    ("environ", "refused"),
    [
        ({}, None),
        ({"OTEL_TRACES_EXPORTER": "none"}, None),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, None),
        ({"OTEL_TRACES_EXPORTER": "console"}, None),
        ({"OTEL_TRACES_EXPORTER": "jaeger"}, "OTEL_TRACES_EXPORTER='jaeger' is not valid"),
        (
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            "OTEL_EXPORTER_OTLP_PROTOCOL='grpc' is not served",
        ),
    ],
)
def test_the_settings_are_checked(environ: dict[str, str], refused: str | None) -> None:
    said = tracing.refusal(environ)
    assert said == refused if refused is None else said is not None and said.startswith(refused)


def test_an_exporter_without_the_extra_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tracing.importlib.util, "find_spec", lambda name: None)
    assert tracing.refusal({"OTEL_TRACES_EXPORTER": "otlp"}) == (
        "OTEL_TRACES_EXPORTER=otlp needs the otel extra: pip install 'petstore[otel]'"
    )
    assert tracing.refusal({}) is None


class Failing:
    """An exporter that refuses every batch, after `delay` seconds."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.batches = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.batches += 1
        time.sleep(self.delay)
        return SpanExportResult.FAILURE

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

    def shutdown(self) -> None:
        pass


def dropped(app: Flask, reason: str) -> float:
    """petstore_trace_spans_dropped_total{reason} as the app's /metrics shows it."""
    text = app.test_client().get("/metrics").get_data(as_text=True)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "petstore_trace_spans_dropped_total":
                if sample.labels == {"reason": reason}:
                    return float(sample.value)
    raise AssertionError(f"no petstore_trace_spans_dropped_total{{reason={reason!r}}}")


def test_spans_lost_are_counted_never_waited_for(
    monkeypatch: pytest.MonkeyPatch, make_app: Callable[..., Flask], auth_headers: dict[str, str]
) -> None:
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "4")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "4")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")
    exporter = Failing(delay=0.5)  # a collector that answers slowly, and refuses
    made = tracing.make_provider(exporter)
    processor = made._active_span_processor._span_processors[0]
    # The pinned SDK's private hook that DropCounter takes over: gone or renamed, this fails.
    assert isinstance(processor._batch_processor._metrics, tracing.DropCounter)
    app = make_app()
    client = app.test_client()
    before = {reason: dropped(app, reason) for reason in tracing.DROP_REASONS}
    tracing.use(made)
    try:
        started = time.perf_counter()
        for _ in range(20):
            assert client.get("/v1/pets", headers=auth_headers).status_code == 200
        took = time.perf_counter() - started
        tracing.flush_at_exit()
    finally:
        tracing.use(None)
    # 20 requests of 4 spans each, through a queue of 4 behind a 0.5 s export: most are dropped.
    assert took < 2.0
    assert dropped(app, "queue_full") - before["queue_full"] >= 40
    assert dropped(app, "export_failed") - before["export_failed"] >= 4
    assert exporter.batches >= 1


def test_the_exit_waits_for_a_slow_collector_at_most_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tracing, "EXIT_FLUSH_SECONDS", 0.3)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "60000")
    made = tracing.make_provider(Failing(delay=5.0))
    tracing.use(made)
    try:
        with tracing.tracer.start_as_current_span("one"):
            pass
        started = time.perf_counter()
        tracing.flush_at_exit()
        took = time.perf_counter() - started
    finally:
        tracing.use(None)
    assert 0.25 <= took < 1.0
    assert [t.name for t in threading.enumerate() if t.name == "petstore-trace-flush"]


def test_a_query_function_outside_a_trace_records_nothing(
    conn: db.Connection, spans: InMemorySpanExporter
) -> None:
    from petstore.queries import pets as pet_sql

    assert pet_sql.find_pet(conn, 1) is None
    assert spans.get_finished_spans() == ()


@pytest.mark.parametrize(
    ("environ", "named"), [({}, "petstore"), ({"OTEL_SERVICE_NAME": "pets-eu"}, "pets-eu")]
)
def test_the_service_is_named_petstore_unless_otel_service_name_says(
    monkeypatch: pytest.MonkeyPatch, environ: dict[str, str], named: str
) -> None:
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    made = tracing.make_provider(Failing())
    assert made.resource.attributes["service.name"] == named
    assert made.resource.attributes["process.pid"] == os.getpid()
