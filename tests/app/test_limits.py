"""Plan-keyed limits, the header policy, IP limits, ProxyFix, strikes and bans (Flask test client, memory://)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from click.testing import CliRunner
from flask import Flask
from werkzeug.test import TestResponse

from petstore import db
from petstore.cli import main as cli
from tests.support.checks import assert_error, every_status, pass_key_cache_bound

RATE_HEADERS = ("X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def numbers(response: TestResponse) -> tuple[int, int, int]:
    """(limit, remaining, reset) from the X-RateLimit-* headers."""
    return tuple(int(response.headers[name]) for name in RATE_HEADERS)  # type: ignore[return-value]


def test_free_key_counts_down_its_minute_budget(client: Any, api_key: str) -> None:
    start = time.time()
    for sent in range(1, 6):
        response = client.get("/v1/pets", headers=bearer(api_key))
        assert response.status_code == 200
        limit, remaining, reset = numbers(response)
        assert (limit, remaining) == (60, 60 - sent)
        assert start + 59 <= reset <= time.time() + 61
    assert "Retry-After" not in response.headers


@pytest.mark.parametrize(("plan", "per_minute"), [("free", 60), ("pro", 300), ("business", 1000)])
def test_each_plan_has_its_numbers(
    client: Any, issue_key: Callable[..., str], plan: str, per_minute: int
) -> None:
    response = client.get("/v1/pets", headers=bearer(issue_key(plan)))
    assert numbers(response)[:2] == (per_minute, per_minute - 1)


def test_plan_change_takes_effect_on_the_next_request(
    client: Any, api_key: str, conn: db.Connection
) -> None:
    """free -> pro between two requests (the key cache's bound apart): the next one counts
    against 300/minute.

    The storage key names the limit's numbers, so the new plan's minute starts a counter of its own.
    """
    assert numbers(client.get("/v1/pets", headers=bearer(api_key)))[:2] == (60, 59)
    assert numbers(client.get("/v1/pets", headers=bearer(api_key)))[:2] == (60, 58)
    conn.execute("update api_keys set plan = 'pro'")
    pass_key_cache_bound(client.application)
    assert numbers(client.get("/v1/pets", headers=bearer(api_key)))[:2] == (300, 299)
    conn.execute("update api_keys set plan = 'free'")
    pass_key_cache_bound(client.application)
    assert numbers(client.get("/v1/pets", headers=bearer(api_key)))[:2] == (60, 57)


def test_one_budget_across_all_routes(client: Any, api_key: str) -> None:
    remaining = [
        numbers(client.get(path, headers=bearer(api_key)))[1]
        for path in ("/v1/pets", "/v1/pets/1", "/v1/store/orders", "/v1/nowhere")
    ]
    assert remaining == [59, 58, 57, 56]


def test_budget_runs_out_with_429_then_daily_numbers_show_near_the_daily_cap(
    client: Any, issue_key: Callable[..., str], conn: db.Connection
) -> None:
    key = issue_key("enterprise", per_minute=5, per_day=8)
    for expected in (4, 3, 2):
        assert numbers(client.get("/v1/pets", headers=bearer(key)))[:2] == (5, expected)
    # New numbers take effect on the next request once the key cache's bound has passed; the
    # day now has fewer left than the minute.
    conn.execute("update api_keys set per_minute = 50")
    pass_key_cache_bound(client.application)
    for expected in (4, 3, 2, 1, 0):
        response = client.get("/v1/pets", headers=bearer(key))
        assert response.status_code == 200
        assert numbers(response)[:2] == (8, expected)
        assert numbers(response)[2] > time.time() + 23 * 3600
    refused = client.get("/v1/pets", headers=bearer(key))
    body = assert_error(refused, 429, "rate_limited")
    assert "8 per day" in body["message"]
    assert numbers(refused)[:2] == (8, 0)
    assert 23 * 3600 < int(refused.headers["Retry-After"]) <= 24 * 3600


def test_429_body_and_headers(client: Any, issue_key: Callable[..., str]) -> None:
    key = issue_key("enterprise", per_minute=2, per_day=100)
    for _ in range(2):
        assert client.get("/v1/pets", headers=bearer(key)).status_code == 200
    response = client.get("/v1/pets", headers=bearer(key))
    body = assert_error(response, 429, "rate_limited")
    assert "2 per minute" in body["message"]
    limit, remaining, reset = numbers(response)
    assert (limit, remaining) == (2, 0)
    retry_after = int(response.headers["Retry-After"])
    assert 1 <= retry_after <= 60
    assert abs(reset - (time.time() + retry_after)) <= 2


def test_requests_without_a_valid_key_are_limited_per_ip(make_app: Callable[..., Flask]) -> None:
    client = make_app(IP_LIMITS="3/minute").test_client()
    attempts = [
        {},
        {"Authorization": "Bearer ps_" + "A" * 43},
        {"Authorization": "Basic dXNlcjpwYXNz"},
    ]
    for expected_remaining, headers in zip((2, 1, 0), attempts, strict=True):
        response = client.get("/v1/pets", headers=headers)
        assert_error(response, 401, "unauthorized")
        assert numbers(response)[:2] == (3, expected_remaining)
    response = client.get("/v1/pets", headers={"Authorization": "Bearer guess"})
    assert_error(response, 429, "rate_limited")
    assert int(response.headers["Retry-After"]) >= 1
    # Another client address has its own budget.
    other = client.get("/v1/pets", environ_base={"REMOTE_ADDR": "127.0.0.2"})
    assert_error(other, 401, "unauthorized")
    assert numbers(other)[:2] == (3, 2)


def ip_budget_used(client: Any, **request: Any) -> int:
    response = client.get("/v1/pets", **request)
    assert response.status_code == 401
    return 3 - numbers(response)[1]


def test_forwarded_for_is_ignored_without_trusted_proxies(make_app: Callable[..., Flask]) -> None:
    client = make_app(IP_LIMITS="3/minute", PROXY_COUNT=0).test_client()
    used = [
        ip_budget_used(client, headers={"X-Forwarded-For": f"203.0.113.{n}"}) for n in (1, 2, 3)
    ]
    assert used == [1, 2, 3]


def test_forwarded_for_from_one_trusted_proxy(make_app: Callable[..., Flask]) -> None:
    client = make_app(IP_LIMITS="3/minute", PROXY_COUNT=1).test_client()
    assert ip_budget_used(client, headers={"X-Forwarded-For": "203.0.113.1"}) == 1
    assert ip_budget_used(client, headers={"X-Forwarded-For": "203.0.113.1"}) == 2
    assert ip_budget_used(client, headers={"X-Forwarded-For": "203.0.113.2"}) == 1
    # A client forging the header: the proxy appends the real address, and only that one is trusted.
    forged = {"X-Forwarded-For": "198.51.100.7, 203.0.113.1"}
    assert ip_budget_used(client, headers=forged) == 3


def test_every_status_carries_the_rate_limit_headers(
    make_app: Callable[..., Flask], api_key: str, issue_key: Callable[..., str]
) -> None:
    app = make_app()
    client = app.test_client()
    seen = every_status(app, api_key)
    seen[410] = make_app(SUNSET=0).test_client().get("/v1/pets/1", headers=bearer(api_key))
    tight = issue_key("enterprise", per_minute=1, per_day=10)
    client.get("/v1/pets", headers=bearer(tight))
    seen[429] = client.get("/v1/pets", headers=bearer(tight))
    down = make_app(DATABASE_URL="postgresql://postgres@127.0.0.1:1/none", DB_POOL_TIMEOUT=0.2)
    seen[503] = down.test_client().get("/v1/pets", headers=bearer(api_key))
    for status, response in sorted(seen.items()):
        assert response.status_code == status, (status, response.get_data(as_text=True))
        limit, remaining, reset = numbers(response)
        assert limit > 0 and 0 <= remaining <= limit and reset > time.time()
        assert ("Retry-After" in response.headers) == (status in (429, 503)), status


def test_health_is_not_limited(client: Any) -> None:
    response = client.get("/healthz")
    assert response.status_code == 200
    assert not set(RATE_HEADERS) & set(response.headers.keys())


def hammer(client: Any, key: str, times: int) -> list[TestResponse]:
    return [client.get("/v1/pets", headers=bearer(key)) for _ in range(times)]


def bans_of(conn: db.Connection) -> list[dict[str, Any]]:
    return conn.execute("select key_id, seconds, strikes from bans order by id").fetchall()


def test_strikes_ban_a_key_which_expires_and_escalates(
    make_app: Callable[..., Flask], issue_key: Callable[..., str], conn: db.Connection
) -> None:
    client = make_app(BAN_THRESHOLD=3, BAN_SECONDS=1).test_client()
    key = issue_key("enterprise", per_minute=2, per_day=1000)
    statuses = [r.status_code for r in hammer(client, key, 5)]
    assert statuses == [200, 200, 429, 429, 429]
    assert bans_of(conn) == [{"key_id": 1, "seconds": 1, "strikes": 3}]

    banned = client.get("/v1/pets", headers=bearer(key))
    body = assert_error(banned, 429, "api_key_banned")
    assert "banned until" in body["message"]
    assert banned.headers["Retry-After"] == "1"
    limit, remaining, reset = numbers(banned)
    assert (limit, remaining) == (2, 0)
    ban_end = conn.execute("select banned_until from bans").fetchone()
    assert ban_end is not None
    assert reset == int(-(-ban_end["banned_until"].timestamp() // 1))

    time.sleep(1.1)
    # The ban ended by itself; the minute is still spent, so the key strikes again: a repeat ban doubles.
    statuses = [r.status_code for r in hammer(client, key, 3)]
    assert statuses == [429, 429, 429]
    assert [b["seconds"] for b in bans_of(conn)] == [1, 2]
    assert_error(client.get("/v1/pets", headers=bearer(key)), 429, "api_key_banned")


def test_banned_requests_spend_no_budget(
    make_app: Callable[..., Flask], issue_key: Callable[..., str], conn: db.Connection
) -> None:
    client = make_app(BAN_THRESHOLD=1, BAN_SECONDS=60).test_client()
    key = issue_key("enterprise", per_minute=1, per_day=5)
    assert [r.status_code for r in hammer(client, key, 2)] == [200, 429]
    for _ in range(10):
        assert_error(client.get("/v1/pets", headers=bearer(key)), 429, "api_key_banned")
    conn.execute("update bans set lifted_at = now()")
    conn.execute("update api_keys set per_minute = 100")
    pass_key_cache_bound(client.application)
    response = client.get("/v1/pets", headers=bearer(key))
    assert response.status_code == 200
    # 1 success + 1 refused by the minute limit (never counted by the day) + this one.
    assert numbers(response)[:2] == (5, 3)


def test_repeat_bans_double_up_to_24_hours(
    make_app: Callable[..., Flask], issue_key: Callable[..., str], conn: db.Connection
) -> None:
    client = make_app(BAN_THRESHOLD=1, BAN_SECONDS=50_000).test_client()
    key = issue_key("enterprise", per_minute=1, per_day=1000)
    hammer(client, key, 2)
    conn.execute("update bans set lifted_at = now()")
    hammer(client, key, 1)
    assert [b["seconds"] for b in bans_of(conn)] == [50_000, 86_400]


def test_ban_escalation_follows_its_settings(
    make_app: Callable[..., Flask], issue_key: Callable[..., str], conn: db.Connection
) -> None:
    """Three times as long, at most 100 s, for a ban less than an hour after the last one ended."""
    escalation = {"BAN_ESCALATION": 3, "BAN_MAX_SECONDS": 100, "BAN_REPEAT_SECONDS": 3600}
    client = make_app(BAN_THRESHOLD=2, BAN_SECONDS=20, **escalation).test_client()
    key = issue_key("enterprise", per_minute=1, per_day=1000)
    warned = assert_error(hammer(client, key, 3)[1], 429, "rate_limited")
    assert warned["message"].endswith(
        "1 more refused request in this window bans this key for 20 seconds (3 times as long as "
        "its last ban, up to 100 seconds, when that ended less than 1 hour ago)."
    )
    for _ in range(3):
        conn.execute("update bans set lifted_at = now()")
        hammer(client, key, 2)
    assert [b["seconds"] for b in bans_of(conn)] == [20, 60, 100, 100]
    conn.execute("update bans set lifted_at = now() - interval '2 hours'")
    hammer(client, key, 2)
    assert [b["seconds"] for b in bans_of(conn)][-1] == 20


def test_ban_holds_across_an_app_restart(
    make_app: Callable[..., Flask], issue_key: Callable[..., str]
) -> None:
    key = issue_key("enterprise", per_minute=1, per_day=1000)
    hammer(make_app(BAN_THRESHOLD=1).test_client(), key, 2)
    restarted = make_app(BAN_THRESHOLD=1).test_client()
    assert_error(restarted.get("/v1/pets", headers=bearer(key)), 429, "api_key_banned")


def test_bans_list_and_lift(
    make_app: Callable[..., Flask], issue_key: Callable[..., str], database_url: str
) -> None:
    client = make_app(BAN_THRESHOLD=1).test_client()
    key = issue_key("enterprise", per_minute=1, per_day=1000)
    hammer(client, key, 2)
    runner = CliRunner()
    env = {"DATABASE_URL": database_url}
    listed = runner.invoke(cli, ["bans", "list"], env=env)
    assert listed.exit_code == 0, listed.output
    assert "active" in listed.output and key not in listed.output
    lifted = runner.invoke(cli, ["bans", "lift", "1"], env=env)
    assert lifted.exit_code == 0, lifted.output
    # memory://: the command cannot see the strikes, so it forgives them again (exit status 0).
    again = runner.invoke(cli, ["bans", "lift", "1"], env=env)
    assert again.exit_code == 0, again.output
    assert "no active ban; its strikes, if any, no longer count" in again.output
    assert "lifted" in runner.invoke(cli, ["bans", "list"], env=env).output
    response = client.get("/v1/pets", headers=bearer(key))
    assert response.status_code == 429
    assert response.get_json()["code"] == "rate_limited"


def test_ipv6_clients_without_a_key_share_the_budget_of_their_64(
    make_app: Callable[..., Flask],
) -> None:
    client = make_app(IP_LIMITS="3/minute", PROXY_COUNT=1).test_client()
    assert ip_budget_used(client, headers={"X-Forwarded-For": "2001:db8:0:1::1"}) == 1
    assert ip_budget_used(client, headers={"X-Forwarded-For": "2001:db8:0:1:ffff::2"}) == 2
    # Another /64 of the same /48 is another subscriber.
    assert ip_budget_used(client, headers={"X-Forwarded-For": "2001:db8:0:2::1"}) == 1


def test_database_trouble_is_503_for_a_valid_key_and_spends_no_budget(
    make_app: Callable[..., Flask], issue_key: Callable[..., str]
) -> None:
    app = make_app(DB_POOL_SIZE=1, DB_POOL_TIMEOUT=0.01, IP_LIMITS="3/minute")
    client = app.test_client()
    key = issue_key("enterprise", per_minute=5, per_day=1000)
    pool = app.extensions["petstore.pool"]
    pool.wait()
    held = pool.getconn()  # the pool's only connection: every key lookup times out
    try:
        for _ in range(10):  # twice the key's budget, three times the address's
            response = client.get("/v1/pets", headers=bearer(key))
            assert_error(response, 503, "service_unavailable")
            assert int(response.headers["Retry-After"]) >= 1
            # The address's budget as it stands, untouched.
            assert numbers(response)[:2] == (3, 3)
    finally:
        pool.putconn(held)
    response = client.get("/v1/pets", headers=bearer(key))
    assert response.status_code == 200
    assert numbers(response)[:2] == (5, 4)
    assert ip_budget_used(client) == 1


def test_addresses_past_the_capacity_share_one_budget(make_app: Callable[..., Flask]) -> None:
    client = make_app(IP_LIMITS="3/minute", PROXY_COUNT=1, ANONYMOUS_CLIENTS=2).test_client()
    assert ip_budget_used(client, headers={"X-Forwarded-For": "203.0.113.1"}) == 1
    assert ip_budget_used(client, headers={"X-Forwarded-For": "203.0.113.2"}) == 1
    # Full: every new address spends the one shared budget, the admitted ones keep theirs.
    assert ip_budget_used(client, headers={"X-Forwarded-For": "203.0.113.3"}) == 1
    assert ip_budget_used(client, headers={"X-Forwarded-For": "203.0.113.4"}) == 2
    assert ip_budget_used(client, headers={"X-Forwarded-For": "2001:db8::1"}) == 3
    assert ip_budget_used(client, headers={"X-Forwarded-For": "203.0.113.1"}) == 2
