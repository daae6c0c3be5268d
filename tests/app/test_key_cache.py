"""Each worker's key cache (petstore.keycache): one query per request, changes seen within the
bound on every instance, what time alone changes exact, bounded memory."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient

from petstore import db, keys
from petstore.caller import caller_at
from petstore.keycache import KeyCache
from petstore.queries import bans as ban_sql
from petstore.queries import keys as key_sql
from tests.support.checks import assert_error, pass_key_cache_bound
from tests.support.databases import store_ban

# What docs/cli.rst, "The key cache" promises with the default PETSTORE_KEY_CACHE_SECONDS (1 s),
# with a second's margin for a loaded machine.
PROPAGATION_BOUND = 2.0
POLL_INTERVAL = 0.05
NEW_PET = {"name": "Rex", "categoryId": 1}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def lookups(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The hashes the database is asked about, in order, by every app of the test."""
    asked: list[bytes] = []
    find = key_sql.find_key_by_hash

    def counted(conn: db.Connection, key_hash: bytes) -> dict[str, Any] | None:
        asked.append(key_hash)
        return find(conn, key_hash)

    monkeypatch.setattr(key_sql, "find_key_by_hash", counted)
    return asked


def issue(conn: db.Connection, **options: Any) -> tuple[str, int]:
    """A new free key: (secret, id)."""
    key, row = keys.issue_key(conn, "free", "cache", **options)
    return key, row["id"]


def wait_until(moment: datetime) -> None:
    """Sleep until just past `moment` (a few seconds away at most)."""
    time.sleep(max(0.0, moment.timestamp() - time.time()) + 0.05)


def test_a_held_key_costs_no_query_until_the_bound_passes(
    client: FlaskClient, conn: db.Connection, lookups: list[bytes]
) -> None:
    key, _key_id = issue(conn)
    for _ in range(3):
        assert client.get("/v1/pets", headers=bearer(key)).status_code == 200
    assert lookups == [keys.hash_key(key)]

    pass_key_cache_bound(client.application)
    assert client.get("/v1/pets", headers=bearer(key)).status_code == 200
    assert len(lookups) == 2


def test_zero_seconds_reads_the_key_on_every_request(
    make_app: Callable[..., Flask], conn: db.Connection, lookups: list[bytes]
) -> None:
    client = make_app(KEY_CACHE_SECONDS=0).test_client()
    key, _key_id = issue(conn)
    for _ in range(3):
        assert client.get("/v1/pets", headers=bearer(key)).status_code == 200
    assert len(lookups) == 3
    assert client.application.extensions["petstore.key_cache"].entries == {}


# Changes committed behind two running instances: (prepare, change, seen). `prepare` sets the
# key up before the instances first see it, `change` is what an operator (or another instance)
# commits, and `seen` tells whether an instance's answer to the key shows the change.
Step = Callable[[db.Connection, int], Any]
Change = tuple[Step, Step, Callable[[FlaskClient, str], bool]]


def nothing(conn: db.Connection, key_id: int) -> None:
    """No preparation."""


def ban(conn: db.Connection, key_id: int) -> None:
    with conn.transaction():
        store_ban(conn, key_id, 3600)


def rotate(conn: db.Connection, key_id: int) -> None:
    """A new secret, the one the instances use staying valid for an hour."""
    assert keys.rotate_key(conn, key_id, 3600) is not None


def end_grace(conn: db.Connection, key_id: int) -> None:
    conn.execute("update api_keys set previous_valid_until = now() where id = %s", [key_id])


def read_only(conn: db.Connection, key_id: int) -> None:
    conn.execute("update api_keys set scopes = '{read}' where id = %s", [key_id])


def to_pro(conn: db.Connection, key_id: int) -> None:
    conn.execute("update api_keys set plan = 'pro' where id = %s", [key_id])


def code_of(client: FlaskClient, key: str) -> str | None:
    body = client.get("/v1/pets", headers=bearer(key)).get_json()
    return body.get("code") if isinstance(body, dict) else None


def status_of(client: FlaskClient, key: str) -> int:
    return client.get("/v1/pets", headers=bearer(key)).status_code


CHANGES: dict[str, Change] = {
    "revocation": (nothing, key_sql.revoke_key, lambda client, key: status_of(client, key) == 401),
    "grace-cut-short": (rotate, end_grace, lambda client, key: status_of(client, key) == 401),
    "scopes": (
        nothing,
        read_only,
        lambda client, key: (
            client.post("/v1/pets", json=NEW_PET, headers=bearer(key)).status_code == 403
        ),
    ),
    "plan": (
        nothing,
        to_pro,
        lambda client, key: (
            client.get("/v1/pets", headers=bearer(key)).headers["X-RateLimit-Limit"] == "300"
        ),
    ),
    "ban": (nothing, ban, lambda client, key: code_of(client, key) == "api_key_banned"),
    "ban-lifted": (ban, ban_sql.lift_bans, lambda client, key: status_of(client, key) == 200),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_change_is_seen_by_two_instances_within_the_bound(
    make_app: Callable[..., Flask], conn: db.Connection, change: str
) -> None:
    """Two apps with their own pools and caches, at the default bound: each holds the key's row,
    the change commits behind them, and both show it within PROPAGATION_BOUND."""
    prepare, make_change, seen = CHANGES[change]
    key, key_id = issue(conn)
    prepare(conn, key_id)
    instances = [make_app().test_client(), make_app().test_client()]
    for client in instances:
        assert client.application.config["KEY_CACHE_SECONDS"] == 1.0
        assert not seen(client, key)
        assert not seen(client, key)

    make_change(conn, key_id)
    committed = time.monotonic()
    pending = instances
    while pending:
        pending = [client for client in pending if not seen(client, key)]
        elapsed = time.monotonic() - committed
        assert elapsed < PROPAGATION_BOUND, f"{change}: not seen after {elapsed:.2f} s"
        if pending:
            time.sleep(POLL_INTERVAL)


def test_expiry_is_exact_whatever_the_bound(
    make_app: Callable[..., Flask], conn: db.Connection, lookups: list[bytes]
) -> None:
    client = make_app(KEY_CACHE_SECONDS=3600).test_client()
    expires_at = datetime.now(UTC) + timedelta(seconds=1)
    key, _key_id = issue(conn, expires_at=expires_at)
    assert client.get("/v1/pets", headers=bearer(key)).status_code == 200

    wait_until(expires_at)
    body = assert_error(client.get("/v1/pets", headers=bearer(key)), 401, "unauthorized")
    assert body["message"] == "The API key has expired."
    assert len(lookups) == 1, "the expiry must be judged on the held row, not by a new query"


def test_the_end_of_an_old_secrets_grace_is_exact_whatever_the_bound(
    make_app: Callable[..., Flask], conn: db.Connection, lookups: list[bytes]
) -> None:
    client = make_app(KEY_CACHE_SECONDS=3600).test_client()
    old, key_id = issue(conn)
    rotated = keys.rotate_key(conn, key_id, 1)
    assert rotated is not None
    new, row = rotated
    assert client.get("/v1/pets", headers=bearer(old)).status_code == 200
    assert client.get("/v1/pets", headers=bearer(new)).status_code == 200

    wait_until(row["previous_valid_until"])
    body = assert_error(client.get("/v1/pets", headers=bearer(old)), 401, "unauthorized")
    assert body["message"] == "The API key is not valid."
    assert client.get("/v1/pets", headers=bearer(new)).status_code == 200
    assert len(lookups) == 2, "the grace must be judged on the held row, not by a new query"


def test_the_end_of_a_ban_is_exact_whatever_the_bound(
    make_app: Callable[..., Flask], conn: db.Connection, lookups: list[bytes]
) -> None:
    client = make_app(KEY_CACHE_SECONDS=3600).test_client()
    key, key_id = issue(conn)
    with conn.transaction():
        stored = store_ban(conn, key_id, 1)
    assert stored is not None
    assert code_of(client, key) == "api_key_banned"

    wait_until(stored["banned_until"])
    assert client.get("/v1/pets", headers=bearer(key)).status_code == 200
    assert len(lookups) == 1, "the ban's end must be judged on the held row, not by a new query"


def test_a_ban_this_worker_stores_is_seen_at_once(
    make_app: Callable[..., Flask], conn: db.Connection
) -> None:
    client = make_app(KEY_CACHE_SECONDS=3600, BAN_THRESHOLD=1).test_client()
    key, _row = keys.issue_key(conn, "enterprise", "cache", per_minute=1, per_day=100)
    assert client.get("/v1/pets", headers=bearer(key)).status_code == 200
    body = assert_error(client.get("/v1/pets", headers=bearer(key)), 429, "rate_limited")
    assert "now banned" in body["message"]
    assert code_of(client, key) == "api_key_banned"


def test_unknown_keys_are_never_held_nor_displace_known_ones(
    make_app: Callable[..., Flask], conn: db.Connection, lookups: list[bytes]
) -> None:
    # Held for an hour: 100 requests on a loaded machine may take longer than the default second.
    client = make_app(
        KEY_CACHE_SIZE=2, KEY_CACHE_SECONDS=3600, IP_LIMITS="1000/minute"
    ).test_client()
    key, _key_id = issue(conn)
    assert client.get("/v1/pets", headers=bearer(key)).status_code == 200
    for _ in range(50):
        unknown = keys.new_key()
        assert client.get("/v1/pets", headers=bearer(unknown)).status_code == 401
        assert client.get("/v1/pets", headers=bearer(unknown)).status_code == 401
    assert len(lookups) == 1 + 100, "an unknown key is asked about every time"
    cache = client.application.extensions["petstore.key_cache"]
    assert list(cache.entries) == [keys.hash_key(key)]
    assert client.get("/v1/pets", headers=bearer(key)).status_code == 200
    assert len(lookups) == 101


def test_the_cache_holds_at_most_its_size_the_least_recently_read_going_first(
    make_app: Callable[..., Flask], conn: db.Connection, lookups: list[bytes]
) -> None:
    client = make_app(KEY_CACHE_SIZE=2).test_client()
    first, second, third = (issue(conn)[0] for _ in range(3))
    for key in (first, second, third):
        assert client.get("/v1/pets", headers=bearer(key)).status_code == 200
    cache = client.application.extensions["petstore.key_cache"]
    assert list(cache.entries) == [keys.hash_key(second), keys.hash_key(third)]
    assert client.get("/v1/pets", headers=bearer(third)).status_code == 200
    assert len(lookups) == 3
    assert client.get("/v1/pets", headers=bearer(first)).status_code == 200
    assert len(lookups) == 4
    assert list(cache.entries) == [keys.hash_key(third), keys.hash_key(first)]


ROW = {
    "id": 1,
    "plan": "free",
    "per_minute": None,
    "per_day": None,
    "scopes": "read write",
    "expires_at": None,
    "grace_until": None,
    "banned_until": None,
    "strikes_forgiven_at": None,
}


def test_a_row_fetched_while_the_key_is_forgotten_is_not_held() -> None:
    """A ban stored while another thread of the worker was reading the key's old row: that row
    must not be held after the ban forgot the key."""
    cache = KeyCache(3600, 10)

    def find_during_a_ban(key_hash: bytes) -> dict[str, Any]:
        cache.forget(1)
        return dict(ROW)

    assert cache.caller(b"h" * 32, find_during_a_ban) == caller_at(ROW, b"h" * 32, time.time())
    assert cache.entries == {}
    assert cache.caller(b"h" * 32, lambda key_hash: dict(ROW)) is not None
    assert list(cache.entries) == [b"h" * 32]


def test_threads_keep_the_cache_within_its_size() -> None:
    cache = KeyCache(3600, 64)
    start = threading.Barrier(8)

    def read_many(thread: int) -> None:
        start.wait()
        for number in range(2000):
            key_hash = f"{thread}:{number % 300}".encode()
            row = cache.caller(key_hash, lambda key_hash, number=number: {**ROW, "id": number})
            assert row is not None

    threads = [threading.Thread(target=read_many, args=(thread,)) for thread in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads)
    assert 0 < len(cache.entries) <= 64


@pytest.fixture
def stopped(make_app: Callable[..., Flask]) -> Iterator[Flask]:
    """An app whose database does not answer: a port nothing listens on."""
    yield make_app(
        DATABASE_URL="postgresql://postgres@127.0.0.1:9/nothing",
        DB_POOL_TIMEOUT=0.2,
        DB_CONNECT_TIMEOUT=1,
    )


def test_a_key_not_held_while_the_database_is_down_is_503(stopped: Flask) -> None:
    response = stopped.test_client().get("/v1/pets", headers=bearer(keys.new_key()))
    assert_error(response, 503, "service_unavailable")
    assert stopped.extensions["petstore.key_cache"].entries == {}


def test_a_refused_key_is_read_again_so_another_instances_ban_is_refused_at_once(
    make_app: Callable[..., Flask], conn: db.Connection, redis_url: str
) -> None:
    """Instance A holds the key's row from before instance B banned it (an hour-long bound): once
    the key is over its limit, A reads it again before striking, and answers the ban."""
    settings = {"KEY_CACHE_SECONDS": 3600, "BAN_THRESHOLD": 1, "RATELIMIT_STORAGE_URI": redis_url}
    first, second = make_app(**settings).test_client(), make_app(**settings).test_client()
    key, _row = keys.issue_key(conn, "enterprise", "cache", per_minute=1, per_day=100)
    assert first.get("/v1/pets", headers=bearer(key)).status_code == 200
    body = assert_error(second.get("/v1/pets", headers=bearer(key)), 429, "rate_limited")
    assert "now banned" in body["message"]

    banned = first.get("/v1/pets", headers=bearer(key))
    assert_error(banned, 429, "api_key_banned")
    assert code_of(first, key) == "api_key_banned"
    count = conn.execute("select count(*) as n from bans").fetchone()
    assert count == {"n": 1}
