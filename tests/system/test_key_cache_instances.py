"""The key cache across two gunicorn instances (separate processes, two workers each, one
PostgreSQL and one Redis): a ban, its lift and a revocation reach every worker of both within
2 s: docs/cli.rst's bound at the default PETSTORE_KEY_CACHE_SECONDS (1 s), with a margin."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from petstore import db, keys
from petstore.queries import bans as ban_sql
from petstore.queries import keys as key_sql
from tests.support.checks import Answer, burst, http_getter
from tests.support.databases import store_ban
from tests.support.servers import ACCESS_PID_FORMAT, Gunicorn

PROPAGATION_BOUND = 2.0
HTTP_TIMEOUT = 10.0
POLL_INTERVAL = 0.05


@pytest.fixture
def instances(database_url: str, redis_url: str, tmp_path: Path) -> Iterator[list[Gunicorn]]:
    """Two gunicorns on the test database and Redis, each with two workers; stopped after."""
    environ = {
        "DATABASE_URL": database_url,
        "RATELIMIT_STORAGE_URI": redis_url,
        "PETSTORE_IP_LIMITS": "1000000/minute;10000000/day",
        # Each request's worker in the log, so that wait_for_workers sees every one answer.
        "GUNICORN_CMD_ARGS": f"--access-logfile - --access-logformat {ACCESS_PID_FORMAT}",
    }
    with ExitStack() as stack:
        servers = [
            stack.enter_context(Gunicorn(environ, tmp_path / f"{name}.log", workers=2, threads=2))
            for name in ("first", "second")
        ]
        for server in servers:
            server.wait_for_workers(answering=True)
        yield servers


def everywhere(getters: list[Callable[[], Answer]]) -> list[Answer]:
    """A burst on new connections to each instance: answers from every worker, most likely."""
    return [answer for get in getters for answer in burst(get, 16, 8)]


def seen_within(
    getters: list[Callable[[], Answer]], shows: Callable[[Answer], bool], what: str
) -> float:
    """Seconds from now until a burst on every instance shows the change in every answer."""
    committed = time.monotonic()
    while True:
        answers = everywhere(getters)
        elapsed = time.monotonic() - committed
        if all(shows(answer) for answer in answers):
            return elapsed
        assert elapsed < PROPAGATION_BOUND, f"{what}: not everywhere after {elapsed:.2f} s"
        time.sleep(POLL_INTERVAL)


def code(answer: Answer) -> str | None:
    return answer.body.get("code") if isinstance(answer.body, dict) else None


def test_ban_lift_and_revocation_reach_every_worker_of_two_instances(
    instances: list[Gunicorn], conn: db.Connection
) -> None:
    key, row = keys.issue_key(conn, "enterprise", "two instances", 100_000, 1_000_000)
    getters = [http_getter(server.url, key, HTTP_TIMEOUT) for server in instances]
    # Every worker holds the key's row.
    assert all(answer.status == 200 for answer in everywhere(getters))

    with conn.transaction():
        assert store_ban(conn, row["id"], 3600)
    banned = seen_within(getters, lambda answer: code(answer) == "api_key_banned", "the ban")

    assert ban_sql.lift_bans(conn, row["id"]) == 1
    lifted = seen_within(getters, lambda answer: answer.status == 200, "the lift")

    assert key_sql.revoke_key(conn, row["id"])
    revoked = seen_within(getters, lambda answer: answer.status == 401, "the revocation")
    print(
        f"seen everywhere after: ban {banned:.2f} s, lift {lifted:.2f} s, revocation {revoked:.2f} s"
    )
