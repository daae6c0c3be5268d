"""Idempotency-Key on POST /v1/pets: replays, conflicts, scope per API key, expiry, races."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from click.testing import CliRunner
from flask import Flask

from petstore import db
from petstore.cli import main as cli
from tests.conftest import count_pets
from tests.support.checks import assert_error

REX = {"name": "Rex", "categoryId": 1, "status": "available"}


def post(client: Any, key: str, body: Any, idempotency_key: str | None) -> Any:
    headers = {"Authorization": f"Bearer {key}"}
    if idempotency_key is not None:
        headers["Idempotency-Key"] = idempotency_key
    return client.post("/v1/pets", json=body, headers=headers)


def test_a_retry_replays_the_first_response(client: Any, api_key: str, conn: db.Connection) -> None:
    first = post(client, api_key, REX, "order-1")
    assert first.status_code == 201
    assert "Idempotent-Replayed" not in first.headers
    # Same request again, with the body spelled differently: same payload, same answer.
    retry = client.post(
        "/v1/pets",
        data='{ "status": "available",  "categoryId": 1, "name": "Rex" }',
        content_type="application/json",
        headers={"Authorization": f"Bearer {api_key}", "Idempotency-Key": "order-1"},
    )
    assert retry.status_code == 201
    assert retry.get_json() == first.get_json()
    assert retry.headers["Location"] == first.headers["Location"]
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert "X-RateLimit-Remaining" in retry.headers
    assert count_pets(conn) == 1


def test_the_same_key_with_another_body_is_refused(
    client: Any, api_key: str, conn: db.Connection
) -> None:
    assert post(client, api_key, REX, "order-2").status_code == 201
    body = assert_error(
        post(client, api_key, {**REX, "name": "Max"}, "order-2"), 409, "idempotency_key_reused"
    )
    assert "Idempotency-Key" in body["message"]
    assert count_pets(conn) == 1


def test_without_a_key_every_post_creates(client: Any, api_key: str, conn: db.Connection) -> None:
    ids = {post(client, api_key, REX, None).get_json()["id"] for _ in range(3)}
    assert len(ids) == 3 and count_pets(conn) == 3


def test_keys_are_scoped_to_the_api_key(
    client: Any, issue_key: Callable[..., str], conn: db.Connection
) -> None:
    first = post(client, issue_key("free"), REX, "shared")
    second = post(client, issue_key("free"), REX, "shared")
    assert first.status_code == second.status_code == 201
    assert first.get_json()["id"] != second.get_json()["id"]
    assert count_pets(conn) == 2


def test_a_rejected_body_records_nothing(client: Any, api_key: str, conn: db.Connection) -> None:
    assert_error(post(client, api_key, {"name": ""}, "order-3"), 400, "invalid_request")
    assert post(client, api_key, REX, "order-3").status_code == 201
    assert count_pets(conn) == 1


@pytest.mark.parametrize(
    "value",
    ["", " ", "x" * 256, "caf\u00e9", "tab\there"],
    ids=["empty", "blank", "long", "non-ascii", "tab"],
)
def test_a_malformed_key_is_a_400(
    client: Any, api_key: str, conn: db.Connection, value: str
) -> None:
    headers = {"Authorization": f"Bearer {api_key}", "Idempotency-Key": value}
    response = client.post("/v1/pets", json=REX, headers=headers)
    body = assert_error(response, 400, "invalid_request")
    assert "Idempotency-Key" in body["message"]
    assert count_pets(conn) == 0


def test_records_expire_after_24_hours(client: Any, api_key: str, conn: db.Connection) -> None:
    first = post(client, api_key, REX, "order-4").get_json()
    conn.execute("update idempotency_requests set created_at = now() - interval '25 hours'")
    again = post(client, api_key, REX, "order-4")
    assert again.status_code == 201
    assert "Idempotent-Replayed" not in again.headers
    assert again.get_json()["id"] != first["id"]
    assert count_pets(conn) == 2


def test_prune_deletes_expired_records(
    client: Any, api_key: str, conn: db.Connection, database_url: str
) -> None:
    post(client, api_key, REX, "old")
    post(client, api_key, REX, "new")
    conn.execute(
        "update idempotency_requests set created_at = now() - interval '25 hours'"
        " where idempotency_key = 'old'"
    )
    result = CliRunner().invoke(cli, ["db", "prune"], env={"DATABASE_URL": database_url})
    assert result.exit_code == 0, result.output
    assert "deleted 1 " in result.output
    remaining = conn.execute("select idempotency_key from idempotency_requests").fetchall()
    assert remaining == [{"idempotency_key": "new"}]


def test_concurrent_requests_with_one_key_create_one_pet(
    make_app: Callable[..., Flask], issue_key: Callable[..., str], conn: db.Connection
) -> None:
    app = make_app(DB_POOL_SIZE=8)
    key = issue_key("enterprise", per_minute=10_000, per_day=10_000)
    racers = 8
    start = threading.Barrier(racers)
    answers: list[Any] = [None] * racers

    def race(slot: int) -> None:
        client = app.test_client()
        start.wait(timeout=10)
        answers[slot] = post(client, key, REX, "race")

    threads = [threading.Thread(target=race, args=(slot,)) for slot in range(racers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert all(not thread.is_alive() for thread in threads)
    assert [answer.status_code for answer in answers] == [201] * racers
    assert len({answer.get_json()["id"] for answer in answers}) == 1
    assert (
        sum(answer.headers.get("Idempotent-Replayed") == "true" for answer in answers) == racers - 1
    )
    assert count_pets(conn) == 1
