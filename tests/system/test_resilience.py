"""Database outages (a prompt 503, recovery without a restart) and concurrent writes through real gunicorn."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
from flask import Flask

from petstore import config, create_app, db, keys
from tests.support.checks import Answer, assert_error, burst, flask_getter, http_getter
from tests.support.servers import Gunicorn, ThrowawayPostgres

# Small bounds so that an outage is noticed within about a second; all are ordinary settings.
POOL_SIZE = 2
POOL_TIMEOUT = 1.0
CONNECT_TIMEOUT = 1
RECONNECT_TIMEOUT = 2.0
STATEMENT_TIMEOUT_MS = 2000
RETRY_AFTER = 2
OUTAGE_SETTINGS: dict[str, Any] = {
    "DB_POOL_SIZE": POOL_SIZE,
    "DB_POOL_TIMEOUT": POOL_TIMEOUT,
    "DB_CONNECT_TIMEOUT": CONNECT_TIMEOUT,
    "DB_RECONNECT_TIMEOUT": RECONNECT_TIMEOUT,
    "DB_STATEMENT_TIMEOUT_MS": STATEMENT_TIMEOUT_MS,
    "RETRY_AFTER": RETRY_AFTER,
}
# The same settings, as gunicorn reads them from the environment.
OUTAGE_ENVIRON = {
    "PETSTORE_DB_POOL_SIZE": str(POOL_SIZE),
    "PETSTORE_DB_POOL_TIMEOUT": str(POOL_TIMEOUT),
    "PETSTORE_DB_CONNECT_TIMEOUT": str(CONNECT_TIMEOUT),
    "PETSTORE_DB_RECONNECT_TIMEOUT": str(RECONNECT_TIMEOUT),
    "PETSTORE_DB_STATEMENT_TIMEOUT_MS": str(STATEMENT_TIMEOUT_MS),
    "PETSTORE_RETRY_AFTER": str(RETRY_AFTER),
}
# A 503 may wait for one pool wait and one connection attempt, plus slack for the rest: it
# catches a request that hangs, it is no benchmark.
UNAVAILABLE_WITHIN = POOL_TIMEOUT + CONNECT_TIMEOUT + 1.0
# Once PostgreSQL is back, the service must answer 200 again within this time, without a restart.
RECOVERED_WITHIN = 15.0
POLL_INTERVAL = 0.2
HTTP_TIMEOUT = 30.0
APP_DBNAME = "petstore"


@dataclass
class Outage:
    """What one stop/start cycle measured."""

    slowest_503: float
    recovery_seconds: float
    attempts_to_recover: int


@pytest.fixture(scope="module")
def throwaway_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThrowawayPostgres]:
    """A PostgreSQL cluster of this module's own with a migrated database; stopped at the end."""
    with ThrowawayPostgres(tmp_path_factory.mktemp("outage") / "pgdata") as cluster:
        cluster.migrated_database(APP_DBNAME)
        yield cluster


@pytest.fixture
def cluster(throwaway_cluster: ThrowawayPostgres) -> ThrowawayPostgres:
    """The throwaway cluster, running at the start of the test whatever the last test did to it."""
    throwaway_cluster.start()
    return throwaway_cluster


@pytest.fixture
def cluster_key(cluster: ThrowawayPostgres) -> str:
    """A key with budget to spare in the throwaway database, issued on a direct connection."""
    with db.connect(config.from_environ({"DATABASE_URL": cluster.url(APP_DBNAME)})) as conn:
        key, _row = keys.issue_key(conn, "enterprise", "resilience", 100_000, 1_000_000)
    return key


@pytest.fixture
def outage_app(cluster: ThrowawayPostgres) -> Iterator[Callable[..., Flask]]:
    """Build apps on the throwaway cluster with the small outage bounds; their pools are closed after."""
    apps: list[Flask] = []

    def build(**overrides: Any) -> Flask:
        settings = {
            "DATABASE_URL": cluster.url(APP_DBNAME),
            "TESTING": True,
            **OUTAGE_SETTINGS,
            **overrides,
        }
        app = create_app(settings)
        apps.append(app)
        return app

    yield build
    for app in apps:
        app.extensions["petstore.pool"].close()


@pytest.fixture
def gunicorn_environ(redis_url: str) -> dict[str, str]:
    """What several gunicorn workers need besides the database: a shared rate-limit storage.

    While PostgreSQL is down no key can be looked up, so requests spend the per-IP budget:
    make it one that no test reaches.
    """
    return {"RATELIMIT_STORAGE_URI": redis_url, "PETSTORE_IP_LIMITS": "1000000/minute;10000000/day"}


def assert_unavailable(answer: Answer) -> None:
    """A prompt, well-formed 503: exactly the Error JSON, its content type and Retry-After."""
    assert_error(answer, 503, "service_unavailable")
    assert answer.headers["retry-after"] == str(RETRY_AFTER), answer
    assert answer.elapsed < UNAVAILABLE_WITHIN, f"503 took {answer.elapsed:.2f} s: {answer}"


def assert_ok(answer: Answer) -> None:
    """A 200 with a JSON array of pets."""
    assert answer.status == 200, answer
    assert isinstance(answer.body, list), answer


def expect_unavailable(get: Callable[[], Answer], times: int) -> float:
    """Request `times` times while the database is down, each a prompt 503; the slowest time."""
    slowest = 0.0
    for _ in range(times):
        answer = get()
        assert_unavailable(answer)
        slowest = max(slowest, answer.elapsed)
    return slowest


def poll_until_ok(get: Callable[[], Answer]) -> tuple[float, int]:
    """Request until a 200, within RECOVERED_WITHIN, each failure a prompt 503; (seconds, attempts)."""
    started = time.monotonic()
    deadline = started + RECOVERED_WITHIN
    attempts = 0
    last: Answer | None = None
    while time.monotonic() < deadline:
        attempts += 1
        last = get()
        if last.status == 200:
            return time.monotonic() - started, attempts
        assert_unavailable(last)
        time.sleep(POLL_INTERVAL)
    raise AssertionError(
        f"no 200 within {RECOVERED_WITHIN} s after PostgreSQL came back ({attempts} attempts; last: {last})"
    )


def stop_and_start(
    cluster: ThrowawayPostgres, get: Callable[[], Answer], down_for: float = 0.0
) -> Outage:
    """Stop the cluster and expect prompt 503s for at least `down_for` s; start it and expect 200s again."""
    url_before = cluster.url(APP_DBNAME)
    cluster.stop()
    slowest = expect_unavailable(get, 3)
    down_until = time.monotonic() + down_for
    while time.monotonic() < down_until:
        slowest = max(slowest, expect_unavailable(get, 1))
    cluster.start()
    assert cluster.url(APP_DBNAME) == url_before, "the cluster came back on another address"
    recovery, attempts = poll_until_ok(get)
    for _ in range(10):
        assert_ok(get())
    return Outage(slowest, recovery, attempts)


def restart_while_idle(cluster: ThrowawayPostgres, get: Callable[[], Answer]) -> None:
    """Restart the cluster between two bursts of requests: it is back, so no request may fail."""
    for answer in burst(get):
        assert_ok(answer)
    url_before = cluster.url(APP_DBNAME)
    # The fast shutdown cuts every pooled connection while the app is not looking.
    cluster.stop()
    cluster.start()
    assert cluster.url(APP_DBNAME) == url_before, "the cluster came back on another address"
    # One request alone first: it meets every cut connection of its pool, one after the other.
    answers = [get(), *burst(get)]
    failed = [answer for answer in answers if answer.status != 200]
    assert not failed, f"{len(failed)} of {len(answers)} failed after the restart: {failed[0]}"
    for answer in answers:
        assert_ok(answer)


def report(name: str, outage: Outage) -> None:
    """Print what an outage measured (shown by `pytest -rP`)."""
    print(
        f"{name}: slowest 503 {outage.slowest_503:.3f} s; 200 again "
        f"{outage.recovery_seconds:.3f} s after the start, at attempt {outage.attempts_to_recover}"
    )


@pytest.mark.parametrize(
    "down_for",
    [0.0, RECONNECT_TIMEOUT + 1.0],
    ids=["short-outage", "outage-longer-than-reconnect-timeout"],
)
def test_database_down_gives_503_then_recovers(
    cluster: ThrowawayPostgres,
    cluster_key: str,
    outage_app: Callable[[], Flask],
    down_for: float,
) -> None:
    """Stop PostgreSQL under a running app: prompt 503s; start it: 200s again, and writes work."""
    app = outage_app()
    get = flask_getter(app, cluster_key, HTTP_TIMEOUT)
    assert_ok(get())

    outage = stop_and_start(cluster, get, down_for)
    report(f"flask, down for {down_for} s", outage)

    response = app.test_client().post(
        "/v1/pets",
        json={"name": "Rex", "categoryId": 1},
        headers={"Authorization": f"Bearer {cluster_key}"},
    )
    assert response.status_code == 201, response.get_json()


def test_app_starts_while_database_is_down(
    cluster: ThrowawayPostgres, cluster_key: str, outage_app: Callable[[], Flask]
) -> None:
    """create_app works without PostgreSQL; requests get 503 until it starts, then 200."""
    cluster.stop()
    get = flask_getter(outage_app(), cluster_key, HTTP_TIMEOUT)
    slowest = expect_unavailable(get, 2)

    cluster.start()
    recovery, attempts = poll_until_ok(get)
    for _ in range(10):
        assert_ok(get())
    report("flask, started while down", Outage(slowest, recovery, attempts))


def test_restart_while_idle_loses_no_request(
    cluster: ThrowawayPostgres, cluster_key: str, outage_app: Callable[[], Flask]
) -> None:
    """Pooled connections cut by a restart are never handed to a request once PostgreSQL is back."""
    restart_while_idle(cluster, flask_getter(outage_app(), cluster_key, HTTP_TIMEOUT))


def test_restart_while_idle_loses_no_request_for_a_held_key(
    cluster: ThrowawayPostgres, cluster_key: str, outage_app: Callable[..., Flask]
) -> None:
    """With the key's row held by the key cache, the view's query is the request's first: it
    too never meets a connection the restart cut."""
    restart_while_idle(
        cluster, flask_getter(outage_app(KEY_CACHE_SECONDS=3600), cluster_key, HTTP_TIMEOUT)
    )


def test_held_and_unheld_keys_get_prompt_503s_while_the_database_is_down(
    cluster: ThrowawayPostgres, cluster_key: str, outage_app: Callable[..., Flask]
) -> None:
    """A key the cache holds gets past identification, and its view's query answers 503; a key
    it does not hold is a 503 at once. Neither hangs nor spends budget into a 429."""
    app = outage_app(KEY_CACHE_SECONDS=3600)
    held = flask_getter(app, cluster_key, HTTP_TIMEOUT)
    assert_ok(held())
    with db.connect(config.from_environ({"DATABASE_URL": cluster.url(APP_DBNAME)})) as conn:
        other, _row = keys.issue_key(conn, "enterprise", "not held", 100_000, 1_000_000)
    unheld = flask_getter(app, other, HTTP_TIMEOUT)

    cluster.stop()
    expect_unavailable(unheld, 3)
    expect_unavailable(held, 3)
    assert app.extensions["petstore.key_cache"].entries.keys() == {keys.hash_key(cluster_key)}
    cluster.start()
    poll_until_ok(unheld)
    assert_ok(held())


def test_gunicorn_workers_recover_after_outage(
    cluster: ThrowawayPostgres, cluster_key: str, gunicorn_environ: dict[str, str], tmp_path: Path
) -> None:
    """The same stop/start cycle through two gunicorn workers, each with the pool it opened after the fork."""
    environ = {"DATABASE_URL": cluster.url(APP_DBNAME), **OUTAGE_ENVIRON, **gunicorn_environ}
    with Gunicorn(environ, tmp_path / "gunicorn.log", workers=2, threads=POOL_SIZE) as server:
        get = http_getter(server.url, cluster_key, HTTP_TIMEOUT)
        # Both workers get pooled connections for the outage to cut.
        for answer in burst(get):
            assert_ok(answer)

        outage = stop_and_start(cluster, get, RECONNECT_TIMEOUT + 1.0)
        report("gunicorn, 2 workers", outage)

        # Consistently 200 from every worker, not only from the one that answered first.
        for answer in burst(get):
            assert_ok(answer)
        assert "Traceback" not in server.log(), server.log()


def test_gunicorn_restart_while_idle_loses_no_request(
    cluster: ThrowawayPostgres, cluster_key: str, gunicorn_environ: dict[str, str], tmp_path: Path
) -> None:
    """No worker hands out a connection cut by a restart that happened between requests."""
    environ = {"DATABASE_URL": cluster.url(APP_DBNAME), **OUTAGE_ENVIRON, **gunicorn_environ}
    with Gunicorn(environ, tmp_path / "gunicorn.log", workers=2, threads=POOL_SIZE) as server:
        restart_while_idle(cluster, http_getter(server.url, cluster_key, HTTP_TIMEOUT))


def test_concurrent_creates_through_gunicorn(
    database_url: str,
    conn: db.Connection,
    issue_key: Callable[..., str],
    gunicorn_environ: dict[str, str],
    tmp_path: Path,
) -> None:
    """50 simultaneous POST /v1/pets over 3 workers x 4 threads: 50 x 201, 50 rows, 50 distinct ids."""
    key = issue_key("enterprise", per_minute=100_000, per_day=1_000_000)
    environ = {"DATABASE_URL": database_url, "PETSTORE_DB_POOL_SIZE": "4", **gunicorn_environ}
    clients = 50
    start_together = threading.Barrier(clients, timeout=HTTP_TIMEOUT)

    with Gunicorn(environ, tmp_path / "gunicorn.log", workers=3, threads=4) as server:

        def create(number: int) -> requests.Response:
            start_together.wait()
            return requests.post(
                f"{server.url}/v1/pets",
                json={"name": f"pet {number}", "categoryId": number, "status": "available"},
                headers={"Authorization": f"Bearer {key}", "Connection": "close"},
                timeout=HTTP_TIMEOUT,
            )

        with ThreadPoolExecutor(max_workers=clients) as executor:
            responses = list(executor.map(create, range(clients)))
        log = server.log()

    assert [r.status_code for r in responses] == [201] * clients, [r.text for r in responses]
    assert "Traceback" not in log, log
    pets = [r.json() for r in responses]
    ids = [pet["id"] for pet in pets]
    assert len(set(ids)) == clients
    for number, (response, pet) in enumerate(zip(responses, pets, strict=True)):
        expected = {"name": f"pet {number}", "categoryId": number, "status": "available"}
        assert pet == {"id": pet["id"], **expected}
        assert response.headers["Location"] == f"/v1/pets/{pet['id']}"

    rows = conn.execute("select id, name, category_id, status from pets").fetchall()
    assert len(rows) == clients
    assert {row["id"] for row in rows} == set(ids)
    assert {(row["id"], row["name"], row["category_id"], row["status"]) for row in rows} == {
        (pet["id"], pet["name"], pet["categoryId"], pet["status"]) for pet in pets
    }
