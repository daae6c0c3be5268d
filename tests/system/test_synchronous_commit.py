"""A commit whose wait for the synchronous standby was cancelled is a 503, never a 201 (durable.durable_write).

A PostgreSQL of the test's own whose synchronous_standby_names names a standby that never
connects: every commit waits for it forever, which is what a primary whose standby was promoted
behind its back does (its Patroni dead). The statement timeout does not bound that wait; the
service cancels it after its own bound, PostgreSQL keeps the commit locally and says so in a
WARNING, and the answer is a 503 with Retry-After. A retry with the same Idempotency-Key is a 503
again while the standby lacks the record, and the recorded 201 once it is replicated. Its trace
shows where the create waited (petstore.tracing). Every write is bounded so (issue 40 §3): the
ban, the usage flush, and with them a stopping worker's exit. And with a real synchronous
standby, a ban the 429 announced is on it when it is promoted.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from flask import Flask
from flask.testing import FlaskClient
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from prometheus_client.parser import text_string_to_metric_families
from psycopg.errors import Diagnostic

from petstore import config, create_app, db, durable, keys, migrations, tracing, usage
from petstore.dev.server import ensure_database
from tests.support.checks import Answer, assert_error, call
from tests.support.servers import Gunicorn, ThrowawayPostgres, poll_until
from tests.support.standby import PostgresServer, make_primary, make_standby

APP_DBNAME = "petstore"
STATEMENT_TIMEOUT_MS = 500
RETRY_AFTER = 1
SETTINGS: dict[str, Any] = {
    "DB_POOL_SIZE": 2,
    "DB_POOL_TIMEOUT": 1.0,
    "DB_STATEMENT_TIMEOUT_MS": STATEMENT_TIMEOUT_MS,
    "RETRY_AFTER": RETRY_AFTER,
}
# A create whose commit waits forever answers within its bound, plus slack for a loaded machine.
ANSWERED_WITHIN = STATEMENT_TIMEOUT_MS / 1000 + durable.COMMIT_WAIT_MARGIN + 1.5
NEW_PET = {"name": "Waits", "categoryId": 3, "status": "available"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThrowawayPostgres]:
    """A migrated database on a PostgreSQL of this module's own."""
    with ThrowawayPostgres(tmp_path_factory.mktemp("sync") / "pgdata") as cluster:
        cluster.migrated_database(APP_DBNAME)
        yield cluster


def wait_for_standby_named(server: ThrowawayPostgres, names: str) -> None:
    """Make `names` the server's synchronous_standby_names, and wait until new sessions see it."""
    with psycopg.connect(server.url(), autocommit=True) as conn:
        conn.execute(
            psycopg.sql.SQL("alter system set synchronous_standby_names = {}").format(
                psycopg.sql.Literal(names)
            )
        )
        conn.execute("select pg_reload_conf()")

    def seen() -> str:
        with psycopg.connect(server.url(), autocommit=True) as conn:
            row = conn.execute("show synchronous_standby_names").fetchone()
        return str(row[0]) if row else ""

    assert poll_until(seen, lambda value: value == names, 10.0, 0.1) == names


@pytest.fixture
def key(server: ThrowawayPostgres) -> str:
    """A key issued while commits need no standby."""
    wait_for_standby_named(server, "")
    with db.connect(config.from_environ({"DATABASE_URL": server.url(APP_DBNAME)})) as conn:
        secret, _row = keys.issue_key(conn, "enterprise", "sync", 10**6, 10**7)
    return secret


@pytest.fixture
def app(server: ThrowawayPostgres, key: str) -> Iterator[Flask]:
    built = create_app({"DATABASE_URL": server.url(APP_DBNAME), "TESTING": True, **SETTINGS})
    yield built
    built.extensions["petstore.pool"].close()
    wait_for_standby_named(server, "")


def count_named(server: ThrowawayPostgres, name: str) -> int:
    with psycopg.connect(server.url(APP_DBNAME), autocommit=True) as conn:
        row = conn.execute("select count(*) from pets where name = %s", [name]).fetchone()
    return int(row[0]) if row else 0


def not_replicated(client: FlaskClient) -> float:
    """petstore_database_errors_total{kind="commit_not_replicated"} on /metrics (0 before any)."""
    text = client.get("/metrics").get_data(as_text=True)
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "petstore_database_errors_total"
        and sample.labels.get("kind") == "commit_not_replicated"
    )


def create(client: FlaskClient, key: str, idempotency_key: str | None, name: str) -> Any:
    headers = {"Authorization": f"Bearer {key}"}
    if idempotency_key is not None:
        headers["Idempotency-Key"] = idempotency_key
    began = time.monotonic()
    response = client.post("/v1/pets", json={**NEW_PET, "name": name}, headers=headers)
    return response, time.monotonic() - began


def test_the_statement_timeout_does_not_bound_a_commits_wait(server: ThrowawayPostgres) -> None:
    """The premise: with statement_timeout at 500 ms, a commit waits for the missing standby for
    as long as nothing cancels it (here 3 s), and a cancel ends the wait with PostgreSQL's WARNING
    that the commit is kept locally."""
    wait_for_standby_named(server, "nobody")
    try:
        notices: list[tuple[bool, str]] = []

        def keep(notice: Diagnostic) -> None:
            notices.append(
                (durable.replication_wait_cancelled(notice), notice.message_detail or "")
            )

        with psycopg.connect(
            server.url(APP_DBNAME), autocommit=True, options="-c statement_timeout=500"
        ) as conn:
            conn.add_notice_handler(keep)
            timer = threading.Timer(3.0, conn.cancel)
            timer.start()
            began = time.monotonic()
            try:
                conn.execute("insert into pets (name, category_id) values ('Premise', 3)")
            finally:
                timer.cancel()
            waited = time.monotonic() - began
        assert waited >= 2.9, waited
        assert [cancelled for cancelled, _detail in notices] == [True], notices
        assert "committed locally" in notices[0][1]
        assert count_named(server, "Premise") == 1
    finally:
        wait_for_standby_named(server, "")


def test_a_cancelled_wait_is_a_503_and_the_retry_no_201_until_replicated(
    server: ThrowawayPostgres, app: Flask, key: str
) -> None:
    """Creates with and without an Idempotency-Key answer 503 with Retry-After within the bound
    (each row committed on this server alone); the same key is a 503 again while the standby is
    missing, and the recorded 201 once commits are replicated."""
    client = app.test_client()
    counted_before = not_replicated(client)
    wait_for_standby_named(server, "nobody")
    response, took = create(client, key, "cancelled-wait-1", "Once")
    assert_error(response, 503, "service_unavailable")
    assert response.headers["Retry-After"] == str(RETRY_AFTER)
    assert took < ANSWERED_WITHIN, took
    assert count_named(server, "Once") == 1  # committed here: exactly the row a failover loses

    response, took = create(client, key, None, "Keyless")
    assert_error(response, 503, "service_unavailable")
    assert took < ANSWERED_WITHIN, took

    response, took = create(client, key, "cancelled-wait-1", "Once")
    assert_error(response, 503, "service_unavailable")  # the record is here, not on the standby
    assert took < ANSWERED_WITHIN, took
    assert count_named(server, "Once") == 1
    assert not_replicated(client) == counted_before + 3

    wait_for_standby_named(server, "")
    response, _took = create(client, key, "cancelled-wait-1", "Once")
    assert response.status_code == 201, response.get_data(as_text=True)
    assert response.headers["Idempotent-Replayed"] == "true"
    assert count_named(server, "Once") == 1

    response, _took = create(client, key, None, "Replicated")
    assert response.status_code == 201
    assert "Idempotent-Replayed" not in response.headers


def test_a_ban_whose_commit_waits_is_cancelled_and_the_429_answers(
    server: ThrowawayPostgres, key: str
) -> None:
    """The strike that bans a key writes the ban under the same bound: the 429 answers within
    it, without saying the key is banned (its ban is on this server alone)."""
    with db.connect(config.from_environ({"DATABASE_URL": server.url(APP_DBNAME)})) as conn:
        hammering, _row = keys.issue_key(conn, "free", "hammers", 1, 1000)
    app = create_app(
        {"DATABASE_URL": server.url(APP_DBNAME), "TESTING": True, "BAN_THRESHOLD": 1, **SETTINGS}
    )
    try:
        client = app.test_client()
        headers = {"Authorization": f"Bearer {hammering}"}
        assert client.get("/v1/pets", headers=headers).status_code == 200
        wait_for_standby_named(server, "nobody")
        began = time.monotonic()
        response = client.get("/v1/pets", headers=headers)  # the strike that bans
        took = time.monotonic() - began
        assert_error(response, 429, "rate_limited")
        assert took < ANSWERED_WITHIN, took
        assert "banned" not in response.get_json()["message"], response.get_json()
    finally:
        app.extensions["petstore.pool"].close()
        wait_for_standby_named(server, "")


def test_a_cancelled_wait_is_a_503_whatever_the_warnings_language(
    server: ThrowawayPostgres, app: Flask, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In another lc_messages the WARNING's text is not recognised: the write the watch cancelled
    is a 503 all the same, never a 201."""
    monkeypatch.setattr(durable, "replication_wait_cancelled", lambda _diagnostic: False)
    client = app.test_client()
    pool = app.extensions["petstore.pool"]
    returned_closed = pool.get_stats().get("returns_bad", 0)
    wait_for_standby_named(server, "nobody")
    response, took = create(client, key, None, "Untranslated")
    assert_error(response, 503, "service_unavailable")
    assert took < ANSWERED_WITHIN, took
    assert count_named(server, "Untranslated") == 1  # committed here alone
    # Closed, not reused: the watch's cancel cannot reach a later request's statement.
    assert pool.get_stats().get("returns_bad", 0) == returned_closed + 1


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def test_the_usage_flush_is_bounded_and_keeps_its_batch(
    server: ThrowawayPostgres, app: Flask, key: str
) -> None:
    """The usage flush writes like every write: its commit's wait is cancelled within the bound
    (before: it waited as long as the standby was missing, the flusher's lock held, and the
    flush at exit behind it), and the batch is kept for the next flush, which writes it."""
    client = app.test_client()
    counter: usage.UsageCounter = app.extensions[usage.EXTENSION]
    usage.flush(app)
    for _ in range(3):
        assert client.get("/v1/pets", headers=bearer(key)).status_code == 200
    wait_for_standby_named(server, "nobody")
    written: list[int] = []
    flushing = threading.Thread(target=lambda: written.append(usage.flush(app)), daemon=True)
    try:
        flushing.start()
        flushing.join(timeout=ANSWERED_WITHIN)
        assert written == [0], "the flush still waits for the commit"
    finally:
        wait_for_standby_named(server, "")  # lets a flush that waits end
        flushing.join(timeout=10)
    assert counter.requests() == 3  # kept for the next batch
    assert usage.flush(app) == 1
    assert counter.requests() == 0


def test_a_stopping_worker_waits_within_its_bounds_on_every_write(
    server: ThrowawayPostgres, key: str, tmp_path: Path
) -> None:
    """SIGTERM while every commit waits for a standby that is gone: a create and a ban in flight,
    the flusher's write too, then the flush at exit. Each ends within its bound, so the worker
    exits by itself, well before gunicorn's graceful timeout would kill it (before: the flush
    waited until then)."""
    with db.connect(config.from_environ({"DATABASE_URL": server.url(APP_DBNAME)})) as conn:
        hammering, _row = keys.issue_key(conn, "free", "hammers at exit", 1, 1000)
    environ = {
        "DATABASE_URL": server.url(APP_DBNAME),
        "PETSTORE_DB_STATEMENT_TIMEOUT_MS": str(STATEMENT_TIMEOUT_MS),
        "PETSTORE_RETRY_AFTER": str(RETRY_AFTER),
        "PETSTORE_BAN_THRESHOLD": "1",
        # The flusher writes all the time: at the SIGTERM, its write is likely in flight.
        "PETSTORE_USAGE_FLUSH_SECONDS": "0.2",
    }
    graceful = 10
    # The requests' bound, then the flush at exit's (the flusher's write and its own within it).
    flush_at_exit = durable.write_bound(config.from_environ(environ)) + usage.EXIT_FLUSH_SECONDS
    exits_within = ANSWERED_WITHIN + flush_at_exit + 1.0
    assert exits_within < graceful
    with Gunicorn(environ, tmp_path / "gunicorn.log", workers=1, stop_timeout=graceful + 2) as web:
        assert call(web.url, "GET", "/v1/pets", headers=bearer(hammering)).status == 200
        wait_for_standby_named(server, "nobody")
        answers: dict[str, Answer] = {}

        def send(name: str, method: str, headers: dict[str, str], body: Any = None) -> None:
            answers[name] = call(web.url, method, "/v1/pets", headers=headers, json_body=body)

        sent = [
            threading.Thread(target=send, args=("create", "POST", bearer(key), NEW_PET)),
            threading.Thread(target=send, args=("ban", "GET", bearer(hammering))),
        ]
        for thread in sent:
            thread.start()
        time.sleep(0.3)  # both wait for their commits now
        began = time.monotonic()
        os.kill(web.pid, signal.SIGTERM)
        assert web.process is not None
        web.process.wait(timeout=graceful + 5)
        took = time.monotonic() - began
        for thread in sent:
            thread.join(timeout=10)
        log = web.log_path.read_text(errors="replace")
    wait_for_standby_named(server, "")
    print(f"\nthe master exited {took:.2f} s after SIGTERM (bound {exits_within:.1f} s)")
    assert took < exits_within, (took, log[-3000:])
    assert_error(answers["create"], 503, "service_unavailable")
    assert answers["ban"].status == 429, answers["ban"]
    assert "banned" not in answers["ban"].body["message"], answers["ban"]
    # The flush at exit gave up within its bound: what it held is lost, and the log says so.
    assert "not written before the worker's exit" in log, log[-3000:]


@pytest.fixture
def standby_pair(tmp_path: Path) -> Iterator[tuple[PostgresServer, PostgresServer]]:
    """A primary whose every commit waits for its synchronous standby, and that standby."""
    primary = make_primary(tmp_path)
    primary.settings["synchronous_standby_names"] = "*"
    with primary:
        with make_standby(tmp_path, primary, "0") as standby:
            with psycopg.connect(primary.url(), autocommit=True) as conn:
                statement = "select count(*) from pg_stat_replication where sync_state = 'sync'"

                def synchronous() -> int:
                    row = conn.execute(statement).fetchone()
                    return int(row[0]) if row else 0

                assert poll_until(synchronous, lambda count: count == 1, 30.0, 0.1) == 1
            yield primary, standby


def test_a_ban_the_429_announced_is_on_the_standby_promoted_after_a_crash(
    standby_pair: tuple[PostgresServer, PostgresServer],
) -> None:
    """The strike that bans answers "now banned" once the ban is on the synchronous standby: the
    primary killed right after (kill -9: it sends nothing more), the standby promoted, the ban is
    there, and an app on it refuses the key as banned."""
    primary, standby = standby_pair
    ensure_database(primary.url(), APP_DBNAME)
    with db.connect(config.from_environ({"DATABASE_URL": primary.url(APP_DBNAME)})) as conn:
        migrations.upgrade(conn)
        secret, row = keys.issue_key(conn, "free", "banned before the crash", 1, 1000)
    overrides = {"TESTING": True, "BAN_THRESHOLD": 1, **SETTINGS}
    app = create_app({"DATABASE_URL": primary.url(APP_DBNAME), **overrides})
    try:
        client = app.test_client()
        assert client.get("/v1/pets", headers=bearer(secret)).status_code == 200
        response = client.get("/v1/pets", headers=bearer(secret))  # the strike that bans
        assert_error(response, 429, "rate_limited")
        assert "now banned" in response.get_json()["message"], response.get_json()
        assert primary.process is not None
        os.killpg(primary.process.pid, signal.SIGKILL)
    finally:
        app.extensions["petstore.pool"].close()
    standby.promote()
    with psycopg.connect(standby.url(APP_DBNAME), autocommit=True) as conn:
        bans = conn.execute(
            "select count(*) from bans where key_id = %s and banned_until > now()", [row["id"]]
        ).fetchone()
    assert bans == (1,)
    promoted = create_app({"DATABASE_URL": standby.url(APP_DBNAME), **overrides})
    try:
        refused = promoted.test_client().get("/v1/pets", headers=bearer(secret))
        assert_error(refused, 429, "api_key_banned")
    finally:
        promoted.extensions["petstore.pool"].close()


def test_a_trace_shows_where_a_create_waited_for_the_standby(
    server: ThrowawayPostgres, app: Flask, key: str
) -> None:
    """Traces (petstore.tracing): the create's statement span holds its commit's wait for the
    missing standby, up to the bound, and durable.write says how it ended (its type alone)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    wait_for_standby_named(server, "nobody")
    tracing.use(provider)
    try:
        response, _took = create(app.test_client(), key, None, "Traced wait")
    finally:
        tracing.use(None)
    assert response.status_code == 503
    by_name = {span.name: span for span in exporter.get_finished_spans()}
    assert set(by_name) >= {"POST /v1/pets", "durable.write", "pets.insert_pet"}
    bound_ns = (STATEMENT_TIMEOUT_MS / 1000 + durable.COMMIT_WAIT_MARGIN) * 1e9

    def took(name: str) -> float:
        span = by_name[name]
        assert span.end_time is not None and span.start_time is not None
        return span.end_time - span.start_time

    assert took("pets.insert_pet") >= bound_ns * 0.9
    assert took("durable.write") >= took("pets.insert_pet")
    assert (by_name["durable.write"].attributes or {})["error.type"] == "CommitNotReplicated"
    assert by_name["POST /v1/pets"].status.status_code is StatusCode.ERROR
