"""Requests per key, UTC hour and outcome (petstore.usage): counted in the worker, written in
batches, a graceful stop's batch written, the aggregate of requests without a valid key."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient

from petstore import db, keys, usage
from petstore.caller import Caller
from petstore.queries import usage as usage_sql
from tests.support.checks import assert_error, every_status

# The flusher of these apps runs rarely: the tests flush themselves.
QUIET = {"USAGE_FLUSH_SECONDS": 3600.0}


def usage_rows(conn: db.Connection) -> dict[int, dict[str, Any]]:
    """key id -> its row of key_usage (one hour only in these tests)."""
    rows = conn.execute("select * from key_usage order by key_id, hour").fetchall()
    return {row["key_id"]: row for row in rows}


def outcomes(row: dict[str, Any]) -> tuple[int, int, int, int]:
    return row["requests_2xx"], row["requests_4xx"], row["requests_429"], row["requests_5xx"]


def test_each_request_is_counted_for_its_key_by_outcome(
    make_app: Callable[..., Flask], conn: db.Connection
) -> None:
    app = make_app(**QUIET)
    key, row = keys.issue_key(conn, "enterprise", "usage", 3, 1000)
    headers = {"Authorization": f"Bearer {key}"}
    client = app.test_client()
    statuses = [
        client.get("/v1/pets", headers=headers).status_code,  # 200
        client.get("/v1/pets/999999", headers=headers).status_code,  # 404
        client.get("/v1/pets?limit=0", headers=headers).status_code,  # 400
        client.get("/v1/pets", headers=headers).status_code,  # 429: 3 a minute
        client.get("/v1/pets", headers=headers).status_code,  # 429
    ]
    assert statuses == [200, 404, 400, 429, 429]
    assert usage_rows(conn) == {}  # nothing written during the requests
    assert usage.flush(app) == 1
    rows = usage_rows(conn)
    assert set(rows) == {row["id"]}
    assert outcomes(rows[row["id"]]) == (1, 2, 2, 0)
    assert rows[row["id"]]["hour"] == datetime.fromtimestamp(time.time() // 3600 * 3600, UTC)


def test_every_status_is_counted_by_its_outcome(
    make_app: Callable[..., Flask], conn: db.Connection
) -> None:
    app = make_app(**QUIET)
    key, row = keys.issue_key(conn, "pro", "usage", None, None)
    answers = every_status(app, key)
    usage.flush(app)
    rows = usage_rows(conn)
    # 200 201 | 400 404 405 413 415 | 500 501 for the key; the 401 without one in the aggregate.
    assert outcomes(rows[row["id"]]) == (2, 5, 0, 2), sorted(answers)
    assert outcomes(rows[usage.AGGREGATE]) == (0, 1, 0, 0)


def test_requests_without_a_valid_key_are_one_aggregate(
    make_app: Callable[..., Flask], conn: db.Connection
) -> None:
    app = make_app(**QUIET)
    client = app.test_client()
    for address in ("192.0.2.1", "192.0.2.2", "198.51.100.7"):
        environ = {"REMOTE_ADDR": address}
        assert client.get("/v1/pets", environ_base=environ).status_code == 401
        bad = {"Authorization": "Bearer ps_" + "x" * 43}
        assert client.get("/v1/pets", headers=bad, environ_base=environ).status_code == 401
    assert client.get("/healthz").status_code == 200  # outside /v1: not counted
    usage.flush(app)
    rows = usage_rows(conn)
    assert set(rows) == {usage.AGGREGATE}
    assert outcomes(rows[usage.AGGREGATE]) == (0, 6, 0, 0)


def test_batches_add_up_across_workers(make_app: Callable[..., Flask], conn: db.Connection) -> None:
    """Two apps (two workers, or two hosts) counting the same key add to the same row."""
    first, second = make_app(**QUIET), make_app(**QUIET)
    key, row = keys.issue_key(conn, "business", "usage", None, None)
    headers = {"Authorization": f"Bearer {key}"}
    for app, requests in ((first, 7), (second, 5), (first, 3)):
        client: FlaskClient = app.test_client()
        for _ in range(requests):
            assert client.get("/v1/pets", headers=headers).status_code == 200
        usage.flush(app)
    assert outcomes(usage_rows(conn)[row["id"]]) == (15, 0, 0, 0)


def test_a_refused_batch_is_kept_for_the_next(
    make_app: Callable[..., Flask], conn: db.Connection
) -> None:
    app = make_app(**QUIET)
    key, row = keys.issue_key(conn, "free", "usage", None, None)
    client = app.test_client()
    assert client.get("/v1/pets", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    # The table refuses writes for a moment (a lock PostgreSQL does not grant in time).
    conn.execute(
        "create or replace function refuse() returns trigger language plpgsql as "
        "$$ begin raise exception 'refused'; end $$"
    )
    conn.execute("create trigger refuse before insert on key_usage execute function refuse()")
    try:
        assert usage.flush(app) == 0
    finally:
        conn.execute("drop trigger refuse on key_usage")
        conn.execute("drop function refuse()")
    assert usage_rows(conn) == {}
    assert client.get("/v1/pets", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    assert usage.flush(app) == 1
    assert outcomes(usage_rows(conn)[row["id"]]) == (2, 0, 0, 0)


def test_the_flusher_writes_within_its_interval(
    make_app: Callable[..., Flask], conn: db.Connection
) -> None:
    app = make_app(USAGE_FLUSH_SECONDS=0.2)
    key, row = keys.issue_key(conn, "free", "usage", None, None)
    assert (
        app.test_client().get("/v1/pets", headers={"Authorization": f"Bearer {key}"}).status_code
        == 200
    )
    deadline = time.monotonic() + 10
    while row["id"] not in usage_rows(conn):
        assert time.monotonic() < deadline, "not written within 10 s"
        time.sleep(0.05)
    assert outcomes(usage_rows(conn)[row["id"]]) == (1, 0, 0, 0)


def test_the_flush_at_exit_writes_the_last_batch(
    make_app: Callable[..., Flask], conn: db.Connection
) -> None:
    import weakref

    app = make_app(**QUIET)
    key, row = keys.issue_key(conn, "free", "usage", None, None)
    assert (
        app.test_client().get("/v1/pets", headers={"Authorization": f"Bearer {key}"}).status_code
        == 200
    )
    usage.flush_at_exit(weakref.ref(app))
    assert outcomes(usage_rows(conn)[row["id"]]) == (1, 0, 0, 0)


def test_prune_deletes_counts_past_the_retention(conn: db.Connection) -> None:
    now = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    old, recent = now - timedelta(days=401), now - timedelta(days=399)
    usage_sql.add_usage(conn, [(1, old, 1, 0, 0, 0), (1, recent, 2, 0, 0, 0)])
    assert usage_sql.delete_usage_before(conn, now - timedelta(days=400)) == 1
    assert [row["hour"] for row in conn.execute("select hour from key_usage")] == [recent]


def test_the_plan_metric_counts_by_plan_and_outcome_never_by_key(
    make_app: Callable[..., Flask], conn: db.Connection
) -> None:
    app = make_app(**QUIET)
    key, _row = keys.issue_key(conn, "pro", "usage", None, None)
    client = app.test_client()
    assert client.get("/v1/pets", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    assert client.get("/v1/pets").status_code == 401
    usage.flush(app)
    text = client.get("/metrics").get_data(as_text=True)
    assert 'petstore_plan_requests_total{outcome="2xx",plan="pro"} 1.0' in text
    assert 'petstore_plan_requests_total{outcome="4xx",plan="none"} 1.0' in text
    assert 'petstore_plan_requests_total{outcome="429",plan="free"} 0.0' in text
    lines = [line for line in text.splitlines() if line.startswith("petstore_plan_requests_total")]
    assert len(lines) == len(usage.PLAN_LABELS) * len(usage_sql.OUTCOMES)


def test_get_usage_shows_the_callers_own_counts_by_day_and_hour(
    make_app: Callable[..., Flask], conn: db.Connection
) -> None:
    app = make_app(**QUIET)
    key, row = keys.issue_key(conn, "free", "usage", None, None)
    _other, other = keys.issue_key(conn, "free", "usage", None, None)
    now = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    yesterday = now - timedelta(days=1)
    usage_sql.add_usage(
        conn,
        [
            (row["id"], yesterday, 5, 1, 0, 0),
            (row["id"], now, 3, 0, 2, 1),
            (other["id"], now, 100, 0, 0, 0),
        ],
    )
    client = app.test_client()
    headers = {"Authorization": f"Bearer {key}"}
    day = f"{yesterday:%Y-%m-%d}"
    answer = client.get(f"/v1/usage?from={day}", headers=headers)
    assert answer.status_code == 200, answer.json
    assert answer.json == {
        "key_id": row["id"],
        "granularity": "day",
        "from": day,
        "to": f"{now:%Y-%m-%d}",
        "usage": [
            {
                "start": f"{yesterday:%Y-%m-%d}T00:00:00Z",
                "requests": 6,
                "outcomes": {"2xx": 5, "4xx": 1, "429": 0, "5xx": 0},
            },
            {
                "start": f"{now:%Y-%m-%d}T00:00:00Z",
                "requests": 6,
                "outcomes": {"2xx": 3, "4xx": 0, "429": 2, "5xx": 1},
            },
        ],
    }
    assert "X-RateLimit-Remaining" in answer.headers
    hourly: dict[str, Any] = client.get("/v1/usage?granularity=hour", headers=headers).json or {}
    assert hourly["from"] == hourly["to"] == f"{now:%Y-%m-%d}"
    assert [b["start"] for b in hourly["usage"]] == [f"{now:%Y-%m-%dT%H}:00:00Z"]
    assert hourly["usage"][0]["requests"] == 6


def test_get_usage_counts_itself_within_its_bucket(
    make_app: Callable[..., Flask], conn: db.Connection
) -> None:
    app = make_app(USAGE_FLUSH_SECONDS=0.2)
    key, row = keys.issue_key(conn, "free", "usage", None, None)
    client = app.test_client()
    headers = {"Authorization": f"Bearer {key}"}

    def buckets() -> list[dict[str, Any]]:
        body: dict[str, Any] = client.get("/v1/usage", headers=headers).json or {}
        return list(body["usage"])

    assert buckets() == []
    deadline = time.monotonic() + 10
    while not (usage_now := buckets()):
        assert time.monotonic() < deadline, "not in its bucket within 10 s"
        time.sleep(0.1)
    assert usage_now[0]["outcomes"]["2xx"] >= 1
    assert row["id"] in usage_rows(conn)


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("from=2026-13-01", "Invalid value for: from."),
        ("to=yesterday", "Invalid value for: to."),
        ("granularity=week", "Invalid value for: granularity."),
        ("key_id=1", "Invalid value for: key_id."),
        (
            "from=2026-11-26&to=2026-11-25",
            "The range is reversed: from 2026-11-26 is after to 2026-11-25.",
        ),
        (
            "from=2026-08-01&to=2026-11-26",
            "The range is too long: at most 90 days with granularity day.",
        ),
        (
            "from=2026-11-01&to=2026-11-08&granularity=hour",
            "The range is too long: at most 7 days with granularity hour.",
        ),
    ],
)
def test_get_usage_refuses_bad_input(
    client: FlaskClient, auth_headers: dict[str, str], query: str, message: str
) -> None:
    answer = client.get(f"/v1/usage?{query}", headers=auth_headers)
    body = assert_error(answer, 400, "invalid_request")
    assert body["message"] == message


def test_get_usage_longest_ranges_are_accepted(
    client: FlaskClient, auth_headers: dict[str, str]
) -> None:
    assert (
        client.get("/v1/usage?from=2026-08-28&to=2026-11-25", headers=auth_headers).status_code
        == 200
    )
    hours = "/v1/usage?from=2026-11-01&to=2026-11-07&granularity=hour"
    assert client.get(hours, headers=auth_headers).status_code == 200


def test_get_usage_needs_a_key_and_the_read_scope(
    make_app: Callable[..., Flask], conn: db.Connection
) -> None:
    app = make_app(**QUIET)
    client = app.test_client()
    assert_error(client.get("/v1/usage"), 401, "unauthorized")
    key, _row = keys.issue_key(conn, "free", "write only", None, None, None, ("write",))
    assert_error(
        client.get("/v1/usage", headers={"Authorization": f"Bearer {key}"}),
        403,
        "insufficient_scope",
    )


def test_many_requests_of_one_caller_make_one_row_of_their_sum(
    make_app: Callable[..., Flask],
) -> None:
    """However many requests a worker counts between two batches, one row per key and hour
    carries their sum (the counting's cost per request is bench/studies/usage_cost.py's and make bench's
    in-process budget's to measure, not a test's)."""
    from flask import Response, g

    app = make_app(**QUIET)
    response = Response(status=200)
    caller = Caller(7, "free", (), frozenset({"read"}), None, False, None, None, b"")
    with app.test_request_context("/v1/pets"):
        g.caller = caller
        for _ in range(5_000):
            usage.count_request(response)
    rows = usage.batch_rows(app.extensions[usage.EXTENSION].take())
    # One row, or two when an hour began meanwhile.
    assert [row[0] for row in rows] in ([7], [7, 7])
    assert sum(row[2] for row in rows) == 5_000
