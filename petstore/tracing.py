"""OpenTelemetry traces (the otel extra), off unless OTEL_TRACES_EXPORTER names an exporter.

Nothing imports opentelemetry until `start` makes a worker's tracer provider (gunicorn's
post_fork: the batch processor's thread is the worker's own). Until then `tracer` is None and
each hook below is one check of it. The spans of a request are listed in docs/monitoring.rst
("Traces"): the server span (pipeline), auth.key_lookup, ratelimit.count, one per query function
(`statement`, with no statement text and no parameter values) and durable.write.

No span records an exception's message, a header or a body: an error is its type alone.
"""

from __future__ import annotations

import atexit
import functools
import importlib.metadata
import importlib.util
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, TypeVar

from flask import Response, request
from prometheus_client import Counter

# This process's tracer and its provider: None while tracing is off.
tracer: Any = None
provider: Any = None
# opentelemetry's trace, context and propagate modules, once a tracer is in use.
_trace: Any = None
_context: Any = None
_propagate: Any = None

EXPORTERS = ("otlp", "console")
# A worker's exit waits at most this long for its last spans to reach the collector (seconds).
EXIT_FLUSH_SECONDS = 2.0
# Why spans were lost: the batch queue was full (OTEL_BSP_MAX_QUEUE_SIZE), or the collector
# refused or never answered an export.
DROP_REASONS = ("queue_full", "export_failed")
# The worker's, not an app's: each app's registry shows it (petstore.metrics).
SPANS_DROPPED = Counter(
    "petstore_trace_spans_dropped",
    "Sampled spans that never reached the collector, by reason: queue_full (the batch queue, "
    "OTEL_BSP_MAX_QUEUE_SIZE, was full) or export_failed (the collector refused or did not answer).",
    ["reason"],
    registry=None,
)

F = TypeVar("F", bound=Callable[..., Any])


class Unrecorded:
    """The span a hook yields while nothing is recorded: its attributes go nowhere."""

    def set_attribute(self, key: str, value: Any) -> None:
        """Nothing to set."""

    def is_recording(self) -> bool:
        """Never."""
        return False


NOTHING = nullcontext(Unrecorded())


def exporter_name(environ: Mapping[str, str]) -> str:
    """OTEL_TRACES_EXPORTER as asked, `none` when unset."""
    return environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() or "none"


def refusal(environ: Mapping[str, str] = os.environ) -> str | None:
    """Why the OTEL_* settings cannot be served, else None (gunicorn's master asks, before forking)."""
    name = exporter_name(environ)
    if name == "none":
        return None
    if name not in EXPORTERS:
        return f"OTEL_TRACES_EXPORTER={name!r} is not valid: expected otlp, console or none"
    protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
    )
    if name == "otlp" and protocol != "http/protobuf":
        return f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not served: only http/protobuf is"
    needed = "opentelemetry.exporter.otlp.proto.http" if name == "otlp" else "opentelemetry.sdk"
    try:
        found = importlib.util.find_spec(needed) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        return f"OTEL_TRACES_EXPORTER={name} needs the otel extra: pip install 'petstore[otel]'"
    return None


def start(environ: Mapping[str, str] = os.environ) -> None:
    """This process's tracer provider, exporting as the OTEL_* variables ask, or nothing when
    OTEL_TRACES_EXPORTER is unset or `none`; flushed at exit within EXIT_FLUSH_SECONDS.

    The SDK reads the rest itself: OTEL_EXPORTER_OTLP_* (endpoint, headers, timeout),
    OTEL_TRACES_SAMPLER and _ARG, OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_BSP_*.
    """
    name = exporter_name(environ)
    if name == "none":
        return
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    if name == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        use(make_provider(OTLPSpanExporter()))
    else:
        use(make_provider(ConsoleSpanExporter()))
    atexit.register(flush_at_exit)


def make_provider(exporter: Any, sampler: Any = None) -> Any:
    """A tracer provider sending through `exporter` in batches, its drops counted.

    The queue is bounded (OTEL_BSP_MAX_QUEUE_SIZE, 2048 spans): a collector that is down or
    slow holds up the batch thread, never a request, and what the full queue turns away is
    counted in petstore_trace_spans_dropped_total, not logged span by span.
    """
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # The worker's pid tells the workers' spans apart (made after the fork: start, post_fork).
    resource = Resource.create(
        {"service.version": importlib.metadata.version("petstore"), "process.pid": os.getpid()}
    )
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": "petstore"}))
    made = TracerProvider(resource=resource, sampler=sampler, shutdown_on_exit=False)
    # CountingExporter is a SpanExporter by its methods: the SDK is not imported before start.
    processor = BatchSpanProcessor(CountingExporter(exporter))  # type: ignore[arg-type]
    # The pinned SDK's hook for what its queue drops (tests/app/test_tracing.py checks it).
    processor._batch_processor._metrics = DropCounter()
    made.add_span_processor(processor)
    # Its "Queue full" warning would be written once per dropped span, on the request's thread.
    logging.getLogger("opentelemetry.sdk._shared_internal").setLevel(logging.ERROR)
    return made


def use(made: Any) -> None:
    """Trace with `made` (a tracer provider), or not at all (None): start's, the tests' and the bench's."""
    global tracer, provider, _trace, _context, _propagate
    if made is not None:
        from opentelemetry import context, propagate, trace

        _trace, _context, _propagate = trace, context, propagate
    provider, tracer = made, None if made is None else made.get_tracer("petstore")


def count_dropped(reason: str, spans: int) -> None:
    """Spans lost before reaching the collector, in petstore_trace_spans_dropped_total."""
    SPANS_DROPPED.labels(reason=reason).inc(spans)


class DropCounter:
    """The batch processor's account of its queue: drops counted, the rest ignored."""

    def register_queue_size(self, get_queue_size: Callable[[], int]) -> None:
        """Not watched."""

    def finish_items(self, count: int) -> None:
        """Handed to the exporter: CountingExporter counts what it fails to send."""

    def drop_items(self, count: int, error_type: str = "queue_full") -> None:
        """Turned away by a full queue (or after shutdown)."""
        count_dropped(error_type, count)


class CountingExporter:
    """An exporter whose failed exports are counted as dropped spans."""

    def __init__(self, exporter: Any) -> None:
        from opentelemetry.sdk.trace.export import SpanExportResult

        self.exporter = exporter
        self.success = SpanExportResult.SUCCESS

    def export(self, spans: Sequence[Any]) -> Any:
        """Send `spans`; count them when they were not delivered."""
        try:
            result = self.exporter.export(spans)
        except Exception:
            count_dropped("export_failed", len(spans))
            raise
        if result is not self.success:
            count_dropped("export_failed", len(spans))
        return result

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """The exporter's."""
        return bool(self.exporter.force_flush(timeout_millis))

    def shutdown(self) -> None:
        """The exporter's."""
        self.exporter.shutdown()


def flush_at_exit() -> None:
    """Send the spans still queued, waiting at most EXIT_FLUSH_SECONDS: the SDK's flush waits
    out its exporter's timeout and retries, so it runs in a thread that the exit does not wait
    for past the bound."""
    if provider is None:
        return
    flush = threading.Thread(target=provider.force_flush, name="petstore-trace-flush", daemon=True)
    flush.start()
    flush.join(EXIT_FLUSH_SECONDS)


def start_request() -> tuple[Any, object] | None:
    """Open the request's server span, named by its route, as the current span; None while off.

    The parent comes from the request's `traceparent` (OTEL_PROPAGATORS, W3C trace context by
    default): a malformed one is ignored, and the request starts a trace of its own.
    """
    if tracer is None:
        return None
    req = request._get_current_object()  # type: ignore[attr-defined]
    route = req.url_rule.rule if req.url_rule is not None else None
    parent = _propagate.extract(req.headers)
    attributes = {"http.request.method": req.method, "url.path": req.path}
    if route is not None:
        attributes["http.route"] = route
    span = tracer.start_span(
        f"{req.method} {route}" if route else req.method,
        parent,
        kind=_trace.SpanKind.SERVER,
        attributes=attributes,
    )
    if not span.is_recording():
        return None  # not sampled: no context to set, as nothing below records or calls out
    return span, _context.attach(_trace.set_span_in_context(span, parent))


def finish_request(opened: tuple[Any, object] | None, response: Response) -> None:
    """Close the server span `start_request` opened (a sampled one), with the response's status."""
    if opened is None:
        return
    span, token = opened
    span.set_attribute("http.response.status_code", response.status_code)
    if response.status_code >= 500:
        span.set_status(_trace.StatusCode.ERROR)
    span.end()
    _context.detach(token)


def recording() -> Any:
    """The current span when tracing is on and it records (the request is sampled), else None."""
    if tracer is None:
        return None
    current = _trace.get_current_span()
    return current if current.is_recording() else None


def span(name: str, attributes: Mapping[str, Any] | None = None) -> AbstractContextManager[Any]:
    """A child span of the current one, as a context manager yielding it; one that records
    nothing (Unrecorded) while off, or while the request is not sampled."""
    return NOTHING if recording() is None else _recorded(name, attributes)


@contextmanager
def _recorded(name: str, attributes: Mapping[str, Any] | None) -> Iterator[Any]:
    """A current span whose error is its exception's type alone: a message may quote a value."""
    with tracer.start_as_current_span(
        name, attributes=attributes, record_exception=False, set_status_on_exception=False
    ) as opened:
        try:
            yield opened
        except BaseException as exc:
            opened.set_attribute("error.type", type(exc).__qualname__)
            opened.set_status(_trace.StatusCode.ERROR)
            raise


def annotate(key: str, value: str) -> None:
    """Set an attribute of the current span, when one records."""
    if tracer is not None:
        _trace.get_current_span().set_attribute(key, value)


def statement(function: F) -> F:
    """Trace each call of a query function (one SQL statement) as a span named by it."""
    name = f"{function.__module__.rsplit('.', 1)[-1]}.{function.__name__}"
    attributes = {"db.system.name": "postgresql"}

    @functools.wraps(function)
    def traced(*args: Any, **kwargs: Any) -> Any:
        with span(name, attributes):
            return function(*args, **kwargs)

    return traced  # type: ignore[return-value]


def current_ids() -> tuple[str, str] | None:
    """(trace_id, span_id) in hex of the current span when it records, for the log lines."""
    current = recording()
    if current is None:
        return None
    ids = current.get_span_context()
    return f"{ids.trace_id:032x}", f"{ids.span_id:016x}"
