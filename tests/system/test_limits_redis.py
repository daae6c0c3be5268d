"""Rate limits with real processes: Redis shared by gunicorn workers, memory:// refused, Redis down or silent."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
import redis
from flask import Flask

from petstore import config, db
from tests.support.checks import (
    Answer,
    assert_banned,
    assert_error,
    burst,
    flask_getter,
    http_getter,
    rate_limit_numbers,
    retry_after,
)
from tests.support.redis_servers import RedisServer, loopback_redis_url
from tests.support.servers import Gunicorn, SilentServer, pid_logging_gunicorn

FREE_PER_MINUTE = 60
# The limiter's socket timeouts (PETSTORE_REDIS_TIMEOUT, here its default), set explicitly.
REDIS_TIMEOUT = 0.25
# While Redis is down or silent, a request may wait for one failed hit and one failed
# re-check of the storage, each bounded by REDIS_TIMEOUT; this bound catches hangs, it is no benchmark.
ANSWER_WITHIN = 2.0
# flask-limiter re-checks a dead storage after 1, 2, 4, ... s; a short outage is over well before this.
RECOVERED_WITHIN = 20.0
POLL_INTERVAL = 0.2
# A request still unanswered after this long hangs (gunicorn's own worker timeout is 30 s).
HANG_LIMIT = 10.0
# A gunicorn that must refuse to start has this long to exit.
EXIT_WITHIN = 20.0
MEMORY_REFUSAL = "RATELIMIT_STORAGE_URI=memory:// counts in one process only"
# Budgets per IP that no test reaches: only the key's budget is under test here.
BASE_ENVIRON = {
    "PETSTORE_IP_LIMITS": "1000000/minute;10000000/day",
    "PETSTORE_REDIS_TIMEOUT": str(REDIS_TIMEOUT),
}
ACCESS_LINE = re.compile(r"access <(\d+)> (\d{3}) GET /v1/")


def limit_headers(answer: Answer, limit: int) -> tuple[int, int]:
    """Check X-RateLimit-* (integers, this limit, a reset within the minute); return (remaining, reset)."""
    remaining, reset = rate_limit_numbers(answer, limit)
    assert 0 <= remaining < limit, answer
    now = time.time()
    assert now - 1 <= reset <= now + 61, (now, answer)
    return remaining, reset


def assert_ok(answer: Answer, limit: int = FREE_PER_MINUTE) -> int:
    """A 200 with a JSON array and the rate-limit headers, no Retry-After; return X-RateLimit-Remaining."""
    assert answer.status == 200, answer
    assert isinstance(answer.body, list), answer
    assert "Retry-After" not in answer.headers, answer
    remaining, _reset = limit_headers(answer, limit)
    return remaining


def assert_rate_limited(answer: Answer, limit: int = FREE_PER_MINUTE) -> None:
    """429 rate_limited: Remaining 0 and Retry-After within the minute window."""
    assert_error(answer, 429, "rate_limited")
    remaining, _reset = limit_headers(answer, limit)
    assert remaining == 0, answer
    assert retry_after(answer) <= 61, answer


def expect_fast_ok(get: Callable[[], Answer], times: int, interval: float = 0.0) -> list[Answer]:
    """Request `times` times (`interval` s apart): each a 200 with headers, answered within ANSWER_WITHIN."""
    answers = []
    for number in range(times):
        if number and interval:
            time.sleep(interval)
        answer = get()
        assert_ok(answer)
        assert answer.elapsed < ANSWER_WITHIN, f"answered in {answer.elapsed:.3f} s: {answer}"
        answers.append(answer)
    return answers


def remainings(answers: Sequence[Answer]) -> list[int]:
    """X-RateLimit-Remaining of each answer."""
    return [int(answer.headers["X-RateLimit-Remaining"]) for answer in answers]


def storage_keys(client: redis.Redis, pattern: str = "*") -> dict[str, str]:
    """The keys in this Redis database that match `pattern`, with their Redis types."""
    names = cast(list[bytes], client.keys(pattern))
    return {name.decode(): cast(bytes, client.type(name)).decode() for name in names}


def counters(client: redis.Redis, pattern: str = "LIMITS:LIMITER/*") -> dict[str, int]:
    """Every limiter counter in this Redis (string keys; moving-window lists count their entries)."""
    values: dict[str, int] = {}
    for name, kind in storage_keys(client, pattern).items():
        value = client.get(name) if kind == "string" else client.llen(name)
        values[name] = int(cast("bytes | int | None", value) or 0)
    return values


def minute_counter(client: redis.Redis, key_id: int = 1) -> int:
    """The value of the key's per-minute fixed-window counter; 0 when there is none."""
    names = [
        name for name in counters(client) if f"/key:{key_id}/" in name and name.endswith("/minute")
    ]
    assert len(names) <= 1, names
    return counters(client)[names[0]] if names else 0


def strategy_of(name: str) -> str:
    """The strategy in a storage key: LIMITS:[{]LIMITER/<strategy>/... or LIMITS:<strategy>/strikes/..."""
    match = re.fullmatch(r"LIMITS:\{?(?:LIMITER/)?([a-z-]+)/.+", name)
    assert match, f"a storage key without the strategy prefix: {name}"
    return match.group(1)


def served_by(log: str, status: int | None = None) -> Counter[int]:
    """How many /v1 answers (of this status) each worker pid served, from the access log."""
    return Counter(
        int(pid) for pid, code in ACCESS_LINE.findall(log) if status in (None, int(code))
    )


def key_id_of(conn: db.Connection) -> int:
    """The id of the only key in the database."""
    rows = conn.execute("select id from api_keys").fetchall()
    assert len(rows) == 1, rows
    key_id: int = rows[0]["id"]
    return key_id


def bans_of(conn: db.Connection, key_id: int) -> list[dict[str, Any]]:
    """The key's ban rows, oldest first."""
    return conn.execute(
        "select banned_until, seconds, strikes, lifted_at from bans where key_id = %(key_id)s order by id",
        {"key_id": key_id},
    ).fetchall()


def report(text: str) -> None:
    """Print a measurement (shown by `pytest -rP`)."""
    print(text)


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    """A client of the test Redis database (emptied by the redis_url fixture)."""
    client = redis.Redis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=5)
    yield client
    client.close()


def counting_in(make_app: Callable[..., Flask], storage_uri: str) -> Flask:
    """An app whose limiter counts in this storage, with the limiter's socket timeouts."""
    return make_app(RATELIMIT_STORAGE_URI=storage_uri, REDIS_TIMEOUT=REDIS_TIMEOUT)


def gunicorn(
    database_url: str,
    storage_uri: str,
    log_path: Path,
    *,
    workers: int,
    threads: int,
    server_class: type[Gunicorn] = Gunicorn,
    **environ: str,
) -> Gunicorn:
    """A gunicorn (not started) on this storage, logging each request's worker pid."""
    return pid_logging_gunicorn(
        database_url,
        storage_uri,
        log_path,
        {**BASE_ENVIRON, **environ},
        workers=workers,
        threads=threads,
        server_class=server_class,
    )


# 1. Exact counting under concurrency -------------------------------------------------------

WORKERS = 4
THREADS = 4
CLIENTS = 32
REQUESTS = 400


def burst_across_workers(
    database_url: str, redis_url: str, key: str, tmp_path: Path, **environ: str
) -> tuple[list[Answer], str]:
    """REQUESTS GETs from CLIENTS threads at a gunicorn of WORKERS booted workers; (answers, its log)."""
    with gunicorn(
        database_url,
        redis_url,
        tmp_path / "gunicorn.log",
        workers=WORKERS,
        threads=THREADS,
        **environ,
    ) as server:
        server.wait_for_workers(answering=True)
        answers = burst(http_getter(server.url, key, HANG_LIMIT), REQUESTS, CLIENTS)
        return answers, server.log_path.read_text()


def test_exact_count_across_gunicorn_workers(
    database_url: str,
    redis_url: str,
    redis_client: redis.Redis,
    issue_key: Callable[..., str],
    tmp_path: Path,
) -> None:
    key = issue_key("free")
    answers, log = burst_across_workers(
        database_url, redis_url, key, tmp_path, PETSTORE_BAN_THRESHOLD="1000000"
    )

    assert Counter(answer.status for answer in answers) == {200: 60, 429: REQUESTS - 60}
    for answer in answers:
        if answer.status == 200:
            assert_ok(answer)
        else:
            assert_rate_limited(answer)
    # Every request of every worker counted in the one Redis: the minute counter saw all of
    # them; the day counter only those the minute limit let through (the first breach stops).
    assert sorted(counters(redis_client).values()) == [60, REQUESTS], counters(redis_client)
    assert sum(served_by(log, 200).values()) == 60, log
    # A worker with counters of its own would answer 200 to its first 60: several must have served.
    workers = served_by(log)
    assert len(workers) >= 2, (
        f"one worker served every request, the count proves nothing: {workers}"
    )
    assert "Traceback" not in log, log
    report(
        f"200s per worker: {dict(served_by(log, 200))}; 429s per worker: {dict(served_by(log, 429))}"
    )


def test_default_threshold_bans_key_under_concurrency(
    database_url: str,
    redis_url: str,
    conn: db.Connection,
    issue_key: Callable[..., str],
    tmp_path: Path,
) -> None:
    key = issue_key("free")
    answers, log = burst_across_workers(
        database_url,
        redis_url,
        key,
        tmp_path,
        PETSTORE_BAN_THRESHOLD="10",
        PETSTORE_BAN_SECONDS="900",
    )

    ban_rows = bans_of(conn, key_id_of(conn))
    assert len(ban_rows) == 1, f"one ban, however many workers saw the threshold: {ban_rows}"
    ban = ban_rows[0]
    assert ban["seconds"] == 900 and ban["strikes"] >= 10 and ban["lifted_at"] is None, ban
    banned_until = ban["banned_until"].timestamp()

    codes = Counter(answer.body["code"] for answer in answers if answer.status == 429)
    assert Counter(answer.status for answer in answers) == {200: 60, 429: REQUESTS - 60}
    assert codes["rate_limited"] >= 10 and codes["api_key_banned"] >= 1, codes
    assert set(codes) == {"rate_limited", "api_key_banned"}, codes
    for answer in answers:
        if answer.status == 200:
            assert_ok(answer)
        elif answer.body["code"] == "rate_limited":
            assert_rate_limited(answer)
        else:
            assert_banned(answer, FREE_PER_MINUTE, banned_until)
    assert "Traceback" not in log, log
    report(f"429s: {dict(codes)}; ban after {ban['strikes']} strikes")


# 2. memory:// refuses more than one worker --------------------------------------------------


class UnwaitedGunicorn(Gunicorn):
    """A gunicorn started without waiting for /healthz: for one that is expected to exit."""

    def wait_healthy(self) -> None:
        """Do not wait: the test waits for the exit instead."""


def test_memory_storage_refuses_several_workers(database_url: str, tmp_path: Path) -> None:
    server = gunicorn(
        database_url,
        "memory://",
        tmp_path / "gunicorn.log",
        workers=2,
        threads=2,
        server_class=UnwaitedGunicorn,
    )
    started = time.monotonic()
    try:
        server.start()
        assert server.process is not None
        try:
            status = server.process.wait(timeout=EXIT_WITHIN)
        except subprocess.TimeoutExpired:
            log = server.log_path.read_text()
            pytest.fail(
                f"gunicorn still runs {EXIT_WITHIN} s after start with memory:// and 2 workers; "
                f"{log.count(MEMORY_REFUSAL)} workers refused, "
                f"{log.count('exited with code')} exits logged; log:\n{server.log()}"
            )
        exited_after = time.monotonic() - started
        log = server.log_path.read_text()
    finally:
        server.stop()
    assert status != 0, log
    assert MEMORY_REFUSAL in log, log
    assert "Use --workers 1" in log, log
    assert server.healthz() is None, "something still answers on the port"
    report(
        f"gunicorn refused memory:// with 2 workers: exit status {status} after {exited_after:.2f} s"
    )


def test_memory_storage_serves_with_one_worker(
    database_url: str, issue_key: Callable[..., str], tmp_path: Path
) -> None:
    key = issue_key("free")
    with gunicorn(
        database_url, "memory://", tmp_path / "gunicorn.log", workers=1, threads=4
    ) as server:
        answers = expect_fast_ok(http_getter(server.url, key, HANG_LIMIT), 3)
        log = server.log_path.read_text()
    assert remainings(answers) == [59, 58, 57]
    assert MEMORY_REFUSAL not in log, log


# 3. Redis down: fallback, then back to Redis -------------------------------------------------


@dataclass
class Outage:
    """What a kill/restart cycle of Redis measured."""

    slowest_while_down: float
    recovery_seconds: float
    attempts_to_recover: int

    def summary(self, served_by: str) -> str:
        """One line for the test report."""
        return (
            f"{served_by}: slowest answer with Redis down {self.slowest_while_down:.3f} s; "
            f"counting in Redis {self.recovery_seconds:.2f} s after its restart "
            f"({self.attempts_to_recover} requests)"
        )


def kill_and_restart(server: RedisServer, get: Callable[[], Answer]) -> Outage:
    """Count in Redis, kill it, expect fast 200s, restart it, expect counting in the new Redis (bounded).

    `get` must reach one process: the remaining counts of its in-memory fallback are checked.
    """
    client = redis.Redis.from_url(server.url(), socket_timeout=5, socket_connect_timeout=5)
    try:
        assert remainings(expect_fast_ok(get, 3)) == [59, 58, 57]
        assert minute_counter(client) == 3

        server.stop()
        client.connection_pool.disconnect()
        # Spread over about 2 s, so that flask-limiter re-checks the dead storage in between.
        down = expect_fast_ok(get, 10, interval=POLL_INTERVAL)
        # Counted in the process's memory meanwhile: a fresh budget, spent one by one.
        assert remainings(down) == list(range(59, 49, -1))
        slowest = max(answer.elapsed for answer in down)

        server.start()
        started = time.monotonic()
        deadline = started + RECOVERED_WITHIN
        attempts = 0
        while not counters(client):
            assert time.monotonic() < deadline, (
                f"no counter in the restarted Redis after {RECOVERED_WITHIN} s"
            )
            attempts += 1
            answer = expect_fast_ok(get, 1)[0]
            slowest = max(slowest, answer.elapsed)
            time.sleep(POLL_INTERVAL)
        recovery = time.monotonic() - started

        # Counting in Redis again: each answer shows the Redis counter's remainder.
        for _ in range(3):
            remaining = expect_fast_ok(get, 1)[0].headers["X-RateLimit-Remaining"]
            assert int(remaining) == FREE_PER_MINUTE - minute_counter(client)
        return Outage(slowest, recovery, attempts)
    finally:
        client.close()


def test_redis_down_falls_back_then_recovers_flask(
    make_app: Callable[..., Flask], issue_key: Callable[..., str], tmp_path: Path
) -> None:
    key = issue_key("free")
    with RedisServer(tmp_path / "redis") as server:
        app = counting_in(make_app, server.url())
        outage = kill_and_restart(server, flask_getter(app, key, HANG_LIMIT))
    report(outage.summary("flask"))


def test_redis_down_falls_back_then_recovers_gunicorn(
    database_url: str, issue_key: Callable[..., str], tmp_path: Path
) -> None:
    key = issue_key("free")
    with RedisServer(tmp_path / "redis") as redis_server:
        # One worker: each worker falls back and recovers on its own schedule, and a test
        # cannot choose which worker serves a request; with one, every step is deterministic.
        with gunicorn(
            database_url, redis_server.url(), tmp_path / "gunicorn.log", workers=1, threads=2
        ) as server:
            outage = kill_and_restart(redis_server, http_getter(server.url, key, HANG_LIMIT))
            log = server.log_path.read_text()
    assert "falling back to in-memory storage" in log, log
    assert "Rate limit storage recovered" in log, log
    report(outage.summary("gunicorn"))


# 4. Redis silent: accepts, never answers ------------------------------------------------------


def test_silent_redis_does_not_hang_flask(
    make_app: Callable[..., Flask], issue_key: Callable[..., str]
) -> None:
    key = issue_key("free")
    with SilentServer() as silent:
        app = counting_in(make_app, loopback_redis_url(silent.port))
        answers = expect_fast_ok(flask_getter(app, key, HANG_LIMIT), 12, interval=POLL_INTERVAL)
        assert silent.accepted, "the limiter never connected to the silent server"
    assert remainings(answers) == list(range(59, 47, -1))
    report(f"flask, silent Redis: slowest answer {max(answer.elapsed for answer in answers):.3f} s")


def test_silent_redis_does_not_hang_gunicorn(
    database_url: str, issue_key: Callable[..., str], tmp_path: Path
) -> None:
    key = issue_key("free")
    with SilentServer() as silent:
        silent_url = loopback_redis_url(silent.port)
        with gunicorn(
            database_url, silent_url, tmp_path / "gunicorn.log", workers=2, threads=2
        ) as server:
            answers = expect_fast_ok(
                http_getter(server.url, key, HANG_LIMIT), 12, interval=POLL_INTERVAL
            )
            log = server.log_path.read_text()
        assert silent.accepted, "the limiter never connected to the silent server"
    assert "falling back to in-memory storage" in log, log
    report(
        f"gunicorn, silent Redis: slowest answer {max(answer.elapsed for answer in answers):.3f} s"
    )


# 5. Strategy switch on the same Redis ---------------------------------------------------------


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("fixed-window", "moving-window"),
        ("moving-window", "fixed-window"),
        ("fixed-window", "sliding-window-counter"),
    ],
)
def test_strategy_switch_ignores_old_keys(
    make_app: Callable[..., Flask],
    redis_url: str,
    redis_client: redis.Redis,
    issue_key: Callable[..., str],
    old: str,
    new: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    key = issue_key("enterprise", per_minute=3, per_day=1000)

    before = flask_getter(
        make_app(RATELIMIT_STORAGE_URI=redis_url, RATELIMIT_STRATEGY=old), key, HANG_LIMIT
    )
    answers = [before() for _ in range(4)]
    assert [assert_ok(answer, 3) for answer in answers[:3]] == [2, 1, 0]
    assert_rate_limited(answers[3], 3)
    old_keys = storage_keys(redis_client)
    assert old_keys, "nothing was counted in Redis"
    assert {strategy_of(name) for name in old_keys} == {old}, old_keys
    assert f"LIMITS:{old}/strikes/1" in old_keys, old_keys

    after = flask_getter(
        make_app(RATELIMIT_STORAGE_URI=redis_url, RATELIMIT_STRATEGY=new), key, HANG_LIMIT
    )
    answers = [after() for _ in range(4)]
    # A budget of its own under the new strategy, counted in Redis (not in the in-memory fallback).
    assert [assert_ok(answer, 3) for answer in answers[:3]] == [2, 1, 0]
    assert_rate_limited(answers[3], 3)
    all_keys = storage_keys(redis_client)
    new_keys = set(all_keys) - set(old_keys)
    assert {strategy_of(name) for name in new_keys} == {new}, all_keys
    assert any("/key:1/" in name for name in new_keys), all_keys
    assert f"LIMITS:{new}/strikes/1" in new_keys, all_keys
    # The old strategy's keys are untouched, types included.
    assert {name: all_keys[name] for name in old_keys} == old_keys
    # No storage error (such as WRONGTYPE) sent the limiter to its in-memory fallback.
    assert "falling back" not in caplog.text, caplog.text


# 6. Bans across workers and restarts -----------------------------------------------------------

# Long enough for the key cache's bound and a restart of 4 workers on a busy machine.
BAN_SECONDS = 12


def test_ban_holds_across_workers_and_restart(
    database_url: str,
    redis_url: str,
    redis_client: redis.Redis,
    conn: db.Connection,
    issue_key: Callable[..., str],
    tmp_path: Path,
) -> None:
    key = issue_key("enterprise", per_minute=2, per_day=1000)
    key_id = key_id_of(conn)

    def server(log_name: str) -> Gunicorn:
        """A gunicorn with small ban numbers on the shared Redis."""
        return gunicorn(
            database_url,
            redis_url,
            tmp_path / log_name,
            workers=WORKERS,
            threads=2,
            PETSTORE_BAN_THRESHOLD="3",
            PETSTORE_BAN_SECONDS=str(BAN_SECONDS),
        )

    with server("first.log") as first:
        first.wait_for_workers(answering=True)
        get = http_getter(first.url, key, HANG_LIMIT)
        assert [assert_ok(get(), 2) for _ in range(2)] == [1, 0]
        # Three strikes: the third 429 stores the ban.
        for _ in range(3):
            assert_rate_limited(get(), 2)
        ban_rows = bans_of(conn, key_id)
        assert len(ban_rows) == 1 and ban_rows[0]["seconds"] == BAN_SECONDS, ban_rows
        banned_until = ban_rows[0]["banned_until"].timestamp()
        # The worker that stored the ban refuses at once; the others once the key rows they
        # hold are older than the key cache's bound, PETSTORE_KEY_CACHE_SECONDS (docs/cli.rst,
        # "The key cache").
        time.sleep(config.SETTINGS["PETSTORE_KEY_CACHE_SECONDS"][2])
        counted = minute_counter(redis_client, key_id)

        answers = burst(get, 32, 16)
        log = first.log_path.read_text()
    for answer in answers:
        assert_banned(answer, 2, banned_until)
    assert minute_counter(redis_client, key_id) == counted, "banned requests spent quota"
    workers = served_by(log, 429)
    assert len(workers) >= 2, f"one worker served every banned request: {workers}"

    with server("second.log") as second:
        get = http_getter(second.url, key, HANG_LIMIT)
        assert time.time() < banned_until - 1, (
            "the restart took longer than the ban: nothing to check"
        )
        assert_banned(get(), 2, banned_until)
        wait = banned_until - time.time() + 0.5
        assert wait <= BAN_SECONDS + 1
        time.sleep(max(0.0, wait))
        answer = get()
    # The ban ended by itself; the minute window opened by the first request may still be spent.
    if answer.status == 200:
        assert_ok(answer, 2)
    else:
        assert_rate_limited(answer, 2)
    assert len(bans_of(conn, key_id)) == 1
    report(
        f"banned answers per worker: {dict(workers)}; ban ended after {BAN_SECONDS} s: {answer.status}"
    )


def test_storage_failing_under_concurrent_requests_never_500(
    make_app: Callable[..., Flask], issue_key: Callable[..., str]
) -> None:
    """Every request that meets the failing storage falls back, not only the first one."""
    key = issue_key("pro")
    with SilentServer() as silent:
        app = counting_in(make_app, loopback_redis_url(silent.port))
        together = threading.Barrier(16, timeout=10)

        def get(_: int) -> int:
            together.wait()
            client = app.test_client()
            return client.get("/v1/pets", headers={"Authorization": f"Bearer {key}"}).status_code

        with ThreadPoolExecutor(16) as pool:
            assert list(pool.map(get, range(16))) == [200] * 16
