"""One clock for every host (issue 27 §4): with Redis, the end of a window is Redis's time.

Two gunicorns count on one Redis, the second with its clock 25 s ahead (libfaketime preloaded,
as an ill-synchronised host). Whichever answers, X-RateLimit-Reset names the same second; each
Date header stays its own host's.
"""

from __future__ import annotations

import time
from email.utils import parsedate_to_datetime
from pathlib import Path

import requests

from petstore import db, keys
from tests.support.checks import http_getter, rate_limit_numbers
from tests.support.programs import faketime_library
from tests.support.servers import Gunicorn

SKEW_SECONDS = 25
PER_MINUTE = 1000
# Requests per host, alternating: enough to cross a second boundary of both clocks.
ROUNDS = 12
ROUND_INTERVAL = 0.15
HTTP_TIMEOUT = 10.0


def test_every_host_names_the_same_reset(
    database_url: str, redis_url: str, conn: db.Connection, tmp_path: Path
) -> None:
    """Two hosts, one 25 s ahead: the same X-RateLimit-Reset from both; the skewed one's Date ahead."""
    library = faketime_library()
    key, _row = keys.issue_key(conn, "enterprise", "one-clock", PER_MINUTE, 100_000)
    environ = {
        "DATABASE_URL": database_url,
        "RATELIMIT_STORAGE_URI": redis_url,
        "PETSTORE_IP_LIMITS": "1000000/minute;10000000/day",
    }
    skewed = {
        **environ,
        "LD_PRELOAD": library,
        "FAKETIME": f"+{SKEW_SECONDS}s",
        # The monotonic clock moves by the same constant: every interval on it stays true.
        # (FAKETIME_DONT_FAKE_MONOTONIC=1 breaks Python's time.sleep with libfaketime 0.9.10.)
    }
    with (
        Gunicorn(environ, tmp_path / "straight.log", workers=1, threads=2) as straight,
        Gunicorn(skewed, tmp_path / "ahead.log", workers=1, threads=2) as ahead,
    ):
        resets: dict[str, set[int]] = {"straight": set(), "ahead": set()}
        dates: dict[str, list[float]] = {"straight": [], "ahead": []}
        for _ in range(ROUNDS):
            for name, app in (("straight", straight), ("ahead", ahead)):
                answer = http_getter(app.url, key, HTTP_TIMEOUT)()
                assert answer.status == 200, answer
                _remaining, reset = rate_limit_numbers(answer, PER_MINUTE)
                resets[name].add(reset)
                date = parsedate_to_datetime(answer.headers["Date"]).timestamp()
                dates[name].append(date - time.time())
            time.sleep(ROUND_INTERVAL)
        # The key's standing, read without counting, names the same end too.
        standings = [
            requests.get(
                f"{app.url}/v1/rate_limit",
                headers={"Authorization": f"Bearer {key}"},
                timeout=HTTP_TIMEOUT,
            ).json()["limits"]["minute"]["reset"]
            for app in (straight, ahead)
        ]
    assert standings == [*resets["straight"]] * 2, (standings, resets)
    # One window, one end, named alike by both hosts.
    assert resets["straight"] == resets["ahead"], resets
    assert len(resets["straight"]) == 1, resets
    # The skew was real: each Date is its own host's clock.
    assert all(abs(offset) <= 2 for offset in dates["straight"]), dates
    assert all(abs(offset - SKEW_SECONDS) <= 2 for offset in dates["ahead"]), dates
