"""Traces from the deployed gunicorn (2 workers) over OTLP/HTTP to a receiver on loopback: spans
from both workers, a traceparent continued through nginx, SIGTERM flushing what was sampled, and
a collector that is down costing requests nothing but dropped spans, counted."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from petstore import db
from tests.support.checks import call
from tests.support.nginx import DeployedGunicorn, Nginx
from tests.support.otlp import OTLPReceiver, outline
from tests.support.redis_servers import RedisServer
from tests.support.servers import SilentServer, poll_until

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"


def tracing_environ(receiver: OTLPReceiver, **more: str) -> dict[str, str]:
    """The standard variables that switch traces on, every request sampled."""
    return {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_SERVICE_NAME": "petstore-under-test",
        "OTEL_TRACES_SAMPLER": "parentbased_always_on",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "PETSTORE_PROXY_COUNT": "1",
        **more,
    }


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """The workers' shared rate limit storage."""
    with RedisServer(tmp_path_factory.mktemp("tracing-redis")) as server:
        yield server


@dataclass
class Traced:
    receiver: OTLPReceiver
    gunicorn: DeployedGunicorn
    nginx: Nginx


@pytest.fixture(scope="module")
def traced(
    database_url: str, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Traced]:
    """A receiver, gunicorn exporting to it with 2 workers, nginx in front; stopped at the end."""
    workdir = tmp_path_factory.mktemp("tracing")
    with OTLPReceiver() as receiver:
        environ = {
            "DATABASE_URL": database_url,
            "RATELIMIT_STORAGE_URI": redis_server.url(),
            **tracing_environ(receiver),
        }
        with (
            DeployedGunicorn(environ, workdir / "gunicorn.log", workers=2) as gunicorn,
            Nginx([gunicorn.address], workdir / "nginx", workers=1) as proxy,
        ):
            yield Traced(receiver, gunicorn, proxy)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_spans_arrive_from_both_workers(
    traced: Traced, conn: db.Connection, issue_key: Callable[..., str]
) -> None:
    headers = {
        **bearer(issue_key("enterprise", per_minute=10**6, per_day=10**7)),
        "Connection": "close",
    }
    workers = traced.gunicorn.wait_for_workers()

    def pids() -> set[int]:
        for _ in range(8):  # new connections, which the workers take in turns
            assert call(traced.gunicorn.url, "GET", "/v1/pets", headers=headers).status == 200
        return {
            span.resource["process.pid"]
            for span in traced.receiver.received()
            if span.name == "GET /v1/pets"
        }

    assert poll_until(pids, lambda found: found >= set(workers), 20.0) >= set(workers)
    (service,) = {span.resource["service.name"] for span in traced.receiver.received()}
    assert service == "petstore-under-test"


def test_a_create_continues_the_callers_trace_through_nginx(
    traced: Traced, conn: db.Connection, issue_key: Callable[..., str]
) -> None:
    headers = {
        **bearer(issue_key("enterprise", per_minute=10**6, per_day=10**7)),
        "traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01",
    }
    pet = {"name": "Traced", "categoryId": 3, "status": "available"}
    answer = call(traced.nginx.url, "POST", "/v1/pets", headers=headers, json_body=pet)
    assert answer.status == 201
    spans = traced.receiver.trace(TRACE_ID, 6)
    (server,) = [span for span in spans if span.name == "POST /v1/pets"]
    assert server.parent_span_id == PARENT_ID
    assert server.attributes["http.response.status_code"] == 201
    assert server.attributes["http.route"] == "/v1/pets"
    lines = outline(spans)
    print("\n" + "\n".join(lines))  # the trace, for the record (pytest -s)
    assert [line.rsplit("  ", 1)[0] for line in lines] == [
        "POST /v1/pets",
        "  auth.key_lookup",
        "    keys.find_key_by_hash",
        "  ratelimit.count",
        "  durable.write",
        "    pets.insert_pet",
    ]
    # The request's log line names the same trace.
    (record,) = traced.gunicorn.logged([answer.headers["X-Request-ID"]]).values()
    assert record["trace_id"] == TRACE_ID
    assert record["span_id"] == server.span_id


def dropped(base_url: str) -> float:
    """petstore_trace_spans_dropped_total over every reason, as /metrics sums the workers."""
    text = call(base_url, "GET", "/metrics").body
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "petstore_trace_spans_dropped_total"
    )


def run_one(
    database_url: str, redis_server: RedisServer, receiver: OTLPReceiver, log: Path, **more: str
) -> DeployedGunicorn:
    """A gunicorn of the test's own, 2 workers, exporting to `receiver`."""
    environ = {"DATABASE_URL": database_url, "RATELIMIT_STORAGE_URI": redis_server.url()}
    return DeployedGunicorn({**environ, **tracing_environ(receiver, **more)}, log, workers=2)


def test_sigterm_sends_what_was_sampled(
    database_url: str,
    redis_server: RedisServer,
    tmp_path: Path,
    conn: db.Connection,
    issue_key: Callable[..., str],
) -> None:
    headers = bearer(issue_key("enterprise", per_minute=10**6, per_day=10**7))
    with OTLPReceiver() as receiver:
        # No batch before the exit: whatever arrives, the exit sent.
        gunicorn = run_one(
            database_url,
            redis_server,
            receiver,
            tmp_path / "g.log",
            OTEL_BSP_SCHEDULE_DELAY="600000",
        )
        with gunicorn:
            sent = [
                call(gunicorn.url, "GET", "/v1/pets", headers=headers).headers["X-Request-ID"]
                for _ in range(10)
            ]
            records = gunicorn.logged(sent)
            assert receiver.received() == []
        trace_ids = {record["trace_id"] for record in records.values()}
        arrived = {span.trace_id for span in receiver.received()}
        assert trace_ids <= arrived
        assert len({span.resource["process.pid"] for span in receiver.received()}) >= 1


def test_a_worker_that_reaches_max_requests_sends_what_was_sampled(
    database_url: str,
    redis_server: RedisServer,
    tmp_path: Path,
    conn: db.Connection,
    issue_key: Callable[..., str],
) -> None:
    headers = {**bearer(issue_key("enterprise", per_minute=10**6, per_day=10**7))}
    with OTLPReceiver() as receiver:
        gunicorn = run_one(
            database_url,
            redis_server,
            receiver,
            tmp_path / "g.log",
            OTEL_BSP_SCHEDULE_DELAY="600000",
            GUNICORN_CMD_ARGS="--max-requests 5",
        )
        with gunicorn:
            first = gunicorn.wait_for_workers()
            sent = [
                call(gunicorn.url, "GET", "/v1/pets", headers=headers).headers["X-Request-ID"]
                for _ in range(12)
            ]
            records = gunicorn.logged(sent)
            # Recycled workers sent theirs on the way out, the service still serving.
            arrived = poll_until(
                lambda: {span.trace_id for span in receiver.received()},
                lambda found: len(found) >= 5,
                10.0,
            )
            assert set(gunicorn.worker_pids()) - set(first)
        assert {span.resource["process.pid"] for span in receiver.received()} & set(first)
        assert len(arrived & {record["trace_id"] for record in records.values()}) >= 5


def test_a_silent_collector_holds_up_neither_requests_nor_the_exit(
    database_url: str,
    redis_server: RedisServer,
    tmp_path: Path,
    conn: db.Connection,
    issue_key: Callable[..., str],
) -> None:
    """A collector that takes connections and never answers: requests as fast, and SIGTERM's
    flush given up after tracing.EXIT_FLUSH_SECONDS rather than the exporter's 30 s."""
    headers = bearer(issue_key("enterprise", per_minute=10**6, per_day=10**7))
    with SilentServer() as silent, OTLPReceiver() as receiver:
        gunicorn = run_one(
            database_url,
            redis_server,
            receiver,
            tmp_path / "g.log",
            OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{silent.port}",
            OTEL_EXPORTER_OTLP_TIMEOUT="30",
        )
        gunicorn.start()
        try:
            slow = latencies(gunicorn.url, headers, 50)
            assert statistics.median(slow) < 0.05
            assert max(slow) < 0.5
            assert silent.accepted  # the exports went there, and wait
        finally:
            started = time.monotonic()
            gunicorn.stop()
            took = time.monotonic() - started
    # The workers' 2 s each, side by side, and gunicorn's own stop; never the exporter's 30 s.
    assert took < 6.0, took
    assert "Worker exiting" in gunicorn.log_path.read_text()


def latencies(base_url: str, headers: Mapping[str, str], requests: int) -> list[float]:
    return [call(base_url, "GET", "/v1/pets", headers=headers).elapsed for _ in range(requests)]


def test_a_collector_down_costs_requests_nothing_and_drops_are_counted(
    database_url: str,
    redis_server: RedisServer,
    tmp_path: Path,
    conn: db.Connection,
    issue_key: Callable[..., str],
) -> None:
    headers = bearer(issue_key("enterprise", per_minute=10**6, per_day=10**7))
    with OTLPReceiver() as receiver:
        gunicorn = run_one(
            database_url,
            redis_server,
            receiver,
            tmp_path / "g.log",
            OTEL_BSP_MAX_QUEUE_SIZE="32",
            OTEL_BSP_MAX_EXPORT_BATCH_SIZE="8",
            OTEL_EXPORTER_OTLP_TIMEOUT="1",
        )
        with gunicorn:
            latencies(gunicorn.url, headers, 20)  # warm: pools, prepared statements
            up = latencies(gunicorn.url, headers, 100)
            assert receiver.received() != []
            before = dropped(gunicorn.url)
            receiver.stop()
            down = latencies(gunicorn.url, headers, 100)
            lost = poll_until(lambda: dropped(gunicorn.url) - before, lambda n: n >= 100, 10.0)
    # 100 requests of 4 spans through queues of 32: most spans are lost, and said to be.
    assert lost >= 100
    assert statistics.median(down) <= statistics.median(up) * 1.5 + 0.002
    assert max(down) < 0.5
