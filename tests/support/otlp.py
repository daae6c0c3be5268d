"""A small OTLP/HTTP receiver on loopback: the spans the service exports, decoded with
opentelemetry-proto, kept in memory for the tests to read."""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from tests.support.servers import LOOPBACK, Service, free_port, poll_until


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as it arrived: ids in hex, times in nanoseconds, attributes as Python values."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]

    @property
    def milliseconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def plain(value: AnyValue) -> Any:
    """An OTLP attribute value as the Python value it carries."""
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


class OTLPReceiver(Service):
    """POST /v1/traces (protobuf, gzip or not) on a free loopback port; `spans` as they arrive."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://{LOOPBACK}:{self.port}"
        self.spans: list[ReceivedSpan] = []
        self.lock = threading.Lock()
        self.server: ThreadingHTTPServer | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        """Listen (again, on the same port) and serve in a background thread."""
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                data = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    data = gzip.decompress(data)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                receiver.add(ExportTraceServiceRequest.FromString(data))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                """Quiet."""

        ThreadingHTTPServer.allow_reuse_address = True
        self.server = ThreadingHTTPServer((LOOPBACK, self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Stop listening: a collector that is down (connections refused); idempotent."""
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
        if self.thread is not None:
            self.thread.join(timeout=5)
            self.thread = None

    def add(self, request: ExportTraceServiceRequest) -> None:
        """Keep the spans of one export."""
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: plain(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                            attributes={a.key: plain(a.value) for a in span.attributes},
                            resource=resource,
                        )
                    )
        with self.lock:
            self.spans.extend(received)

    def received(self) -> list[ReceivedSpan]:
        """Every span so far."""
        with self.lock:
            return list(self.spans)

    def trace(self, trace_id: str, spans: int, within: float = 10.0) -> list[ReceivedSpan]:
        """The spans of one trace, waiting (bounded) until at least `spans` of them arrived."""
        return poll_until(
            lambda: [span for span in self.received() if span.trace_id == trace_id],
            lambda found: len(found) >= spans,
            within,
        )


def outline(spans: list[ReceivedSpan]) -> list[str]:
    """A trace as indented lines, children in the order they started: name and milliseconds."""
    ids = {span.span_id for span in spans}
    children: dict[str, list[ReceivedSpan]] = {}
    for span in sorted(spans, key=lambda span: span.start_ns):
        parent = span.parent_span_id if span.parent_span_id in ids else ""
        children.setdefault(parent, []).append(span)
    lines: list[str] = []

    def walk(parent: str, depth: int) -> None:
        for span in children.get(parent, []):
            lines.append(f"{'  ' * depth}{span.name}  {span.milliseconds:.2f} ms")
            walk(span.span_id, depth + 1)

    walk("", 0)
    return lines
