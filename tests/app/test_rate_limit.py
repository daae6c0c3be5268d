"""GET /v1/rate_limit: the caller's own standing, spending no budget and counting no strike."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import redis
from click.testing import CliRunner
from flask import Flask
from flask.testing import FlaskClient

from petstore.cli import main
from tests.support.checks import assert_error, pass_key_cache_bound


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def standing(client: FlaskClient, key: str) -> dict[str, Any]:
    response = client.get("/v1/rate_limit", headers=bearer(key))
    assert response.status_code == 200, response.get_data(as_text=True)
    assert response.mimetype == "application/json"
    body = response.get_json()
    assert isinstance(body, dict)
    return body


def test_the_body_has_exactly_the_documented_fields(client: FlaskClient, api_key: str) -> None:
    for _ in range(3):
        assert client.get("/v1/pets", headers=bearer(api_key)).status_code == 200
    now = time.time()

    body = standing(client, api_key)

    assert list(body) == ["plan", "limits", "ban", "strikes"]
    assert body["plan"] == "free"
    assert list(body["limits"]) == ["minute", "day"]
    for name, limit, window in (("minute", 60, 60), ("day", 1000, 86400)):
        numbers = body["limits"][name]
        assert list(numbers) == ["limit", "remaining", "used", "reset"]
        assert (numbers["limit"], numbers["remaining"], numbers["used"]) == (limit, limit - 3, 3)
        assert now < numbers["reset"] <= now + window + 1
    assert body["ban"] is None
    assert body["strikes"] == {"count": 0, "threshold": 10}


def test_it_spends_no_budget(client: FlaskClient, api_key: str) -> None:
    before = client.get("/v1/pets", headers=bearer(api_key))
    for _ in range(5):
        answer = client.get("/v1/rate_limit", headers=bearer(api_key))
        assert answer.headers["X-RateLimit-Remaining"] == before.headers["X-RateLimit-Remaining"]
    after = client.get("/v1/pets", headers=bearer(api_key))
    assert (
        int(after.headers["X-RateLimit-Remaining"])
        == int(before.headers["X-RateLimit-Remaining"]) - 1
    )
    assert standing(client, api_key)["limits"]["minute"]["used"] == 2


def test_while_throttled_it_answers_200_and_counts_no_strike(
    client: FlaskClient, issue_key: Callable[..., str]
) -> None:
    key = issue_key("enterprise", per_minute=2, per_day=500)
    codes = [client.get("/v1/pets", headers=bearer(key)).status_code for _ in range(4)]
    assert codes == [200, 200, 429, 429]

    for _ in range(20):
        body = standing(client, key)

    assert body["plan"] == "enterprise"
    assert body["limits"]["minute"] == {
        **body["limits"]["minute"],
        "limit": 2,
        "remaining": 0,
        "used": 2,
    }
    assert body["limits"]["day"]["limit"] == 500
    assert body["strikes"] == {"count": 2, "threshold": 10}
    assert body["ban"] is None


def test_while_banned_it_answers_200_with_the_end_of_the_ban(
    make_app: Callable[..., Flask], issue_key: Callable[..., str]
) -> None:
    client = make_app(BAN_THRESHOLD=2).test_client()
    key = issue_key("enterprise", per_minute=1, per_day=500)
    for _ in range(3):
        client.get("/v1/pets", headers=bearer(key))
    banned = client.get("/v1/pets", headers=bearer(key))
    assert_error(banned, 429, "api_key_banned")
    until = int(banned.headers["X-RateLimit-Reset"])

    body = standing(client, key)

    assert body["ban"] == {"until": until}
    assert body["strikes"] == {"count": 0, "threshold": 2}  # a ban starts a new count


def test_per_key_overrides_show_the_keys_own_numbers(
    client: FlaskClient, issue_key: Callable[..., str]
) -> None:
    key = issue_key("pro", per_minute=7)
    limits = standing(client, key)["limits"]
    assert (limits["minute"]["limit"], limits["day"]["limit"]) == (7, 10_000)


def test_without_a_valid_key_it_is_a_401_spending_the_address_budget(
    make_app: Callable[..., Flask],
) -> None:
    client = make_app(IP_LIMITS="2/minute").test_client()
    for remaining, headers in ((1, {}), (0, bearer("ps_" + "A" * 43))):
        response = client.get("/v1/rate_limit", headers=headers)
        assert_error(response, 401, "unauthorized")
        assert response.headers["X-RateLimit-Remaining"] == str(remaining)
    assert_error(client.get("/v1/rate_limit"), 429, "rate_limited")


def test_a_read_only_key_reads_it(
    client: FlaskClient, conn: Any, issue_key: Callable[..., str]
) -> None:
    key = issue_key("free")
    conn.execute("update api_keys set scopes = '{read}'")
    assert standing(client, key)["plan"] == "free"


def test_redis_storage_gives_the_same_standing(
    make_app: Callable[..., Flask], issue_key: Callable[..., str], redis_url: str
) -> None:
    client = make_app(RATELIMIT_STORAGE_URI=redis_url).test_client()
    key = issue_key("enterprise", per_minute=1, per_day=50)
    codes = [client.get("/v1/pets", headers=bearer(key)).status_code for _ in range(3)]
    assert codes == [200, 429, 429]

    body = standing(client, key)

    assert body["limits"]["minute"]["remaining"] == 0
    assert body["limits"]["day"]["used"] == 1
    assert body["strikes"]["count"] == 2


# No ban without warning


def test_each_429_says_how_many_more_ban_the_key_and_for_how_long(
    make_app: Callable[..., Flask], issue_key: Callable[..., str]
) -> None:
    client = make_app(BAN_THRESHOLD=3, BAN_SECONDS=900).test_client()
    key = issue_key("enterprise", per_minute=1, per_day=500)
    answers = [client.get("/v1/pets", headers=bearer(key)) for _ in range(5)]

    messages = [
        assert_error(answer, 429, code)["message"]
        for answer, code in zip(
            answers[1:],
            ["rate_limited", "rate_limited", "rate_limited", "api_key_banned"],
            strict=True,
        )
    ]

    assert messages[0] == (
        "Rate limit exceeded: 1 per minute. 2 more refused requests in this window ban this key "
        "for 15 minutes (twice as long as its last ban, up to 24 hours, when that ended less "
        "than 24 hours ago)."
    )
    assert "1 more refused request in this window bans this key for 15 minutes" in messages[1]
    assert messages[2] == (
        "Rate limit exceeded: 1 per minute. This key is now banned for 15 minutes for calling "
        "on after 429 responses."
    )
    assert messages[3].startswith("This API key is banned until")


def test_429s_without_a_key_carry_no_ban_warning(make_app: Callable[..., Flask]) -> None:
    client = make_app(IP_LIMITS="1/minute").test_client()
    client.get("/v1/pets")
    body = assert_error(client.get("/v1/pets"), 429, "rate_limited")
    assert body["message"] == "Rate limit exceeded: 1 per minute."


def test_bans_lift_forgives_the_strikes_of_a_key_without_a_ban(
    make_app: Callable[..., Flask],
    issue_key: Callable[..., str],
    redis_url: str,
    database_url: str,
) -> None:
    """Two refusals, `bans lift`, one more refusal: rate_limited, not api_key_banned."""
    client = make_app(RATELIMIT_STORAGE_URI=redis_url, BAN_THRESHOLD=3).test_client()
    key = issue_key("enterprise", per_minute=1, per_day=500)
    for _ in range(3):
        client.get("/v1/pets", headers=bearer(key))  # 1 answer, 2 refusals: 2 strikes, no ban
    assert standing(client, key)["strikes"]["count"] == 2
    environ = {"DATABASE_URL": database_url, "RATELIMIT_STORAGE_URI": redis_url}

    lifted = CliRunner().invoke(main, ["bans", "lift", "1"], env=environ)
    again = CliRunner().invoke(main, ["bans", "lift", "1"], env=environ)

    assert lifted.exit_code == 0, lifted.output
    assert lifted.output == (
        "key 1 has no active ban; cleared its 2 strikes: it starts again from a full threshold\n"
    )
    assert standing(client, key)["strikes"]["count"] == 0
    assert_error(client.get("/v1/pets", headers=bearer(key)), 429, "rate_limited")
    assert standing(client, key) == {**standing(client, key), "ban": None}
    assert again.exit_code == 4, again.output
    assert again.stderr == "Error: key 1 has no active ban and no strikes: nothing to do\n"


def test_bans_lift_forgives_strikes_counted_in_the_services_memory(
    make_app: Callable[..., Flask], issue_key: Callable[..., str], database_url: str
) -> None:
    """memory://: two strikes in the service, `bans lift` from the CLI, and the next refusal
    counts the first strike of a full threshold again (issue 27 §5)."""
    client = make_app(RATELIMIT_STORAGE_URI="memory://", BAN_THRESHOLD=3).test_client()
    key = issue_key("enterprise", per_minute=1, per_day=500)
    for _ in range(3):
        client.get("/v1/pets", headers=bearer(key))  # 1 answer, 2 refusals: 2 strikes, no ban
    assert standing(client, key)["strikes"]["count"] == 2
    environ = {"DATABASE_URL": database_url, "RATELIMIT_STORAGE_URI": "memory://"}

    lifted = CliRunner().invoke(main, ["bans", "lift", "1"], env=environ)

    assert lifted.exit_code == 0, lifted.output
    assert lifted.output == (
        "key 1 has no active ban; its strikes, if any, no longer count in any worker: it starts "
        "again from a full threshold\n"
    )
    # The refusal's strike reads the key's row again: the lift counts at once, not after the cache.
    refused = client.get("/v1/pets", headers=bearer(key))
    assert_error(refused, 429, "rate_limited")
    assert "2 more refused requests in this window ban this key" in refused.get_json()["message"]
    assert standing(client, key)["strikes"]["count"] == 1
    assert_error(client.get("/v1/pets", headers=bearer(key)), 429, "rate_limited")
    assert standing(client, key)["strikes"]["count"] == 2
    assert standing(client, key)["ban"] is None


def test_bans_lift_clears_the_strikes(
    make_app: Callable[..., Flask],
    issue_key: Callable[..., str],
    redis_url: str,
    database_url: str,
) -> None:
    client = make_app(RATELIMIT_STORAGE_URI=redis_url, BAN_THRESHOLD=3).test_client()
    other = issue_key("enterprise", per_minute=1, per_day=500)
    key = issue_key("enterprise", per_minute=1, per_day=500)
    for _ in range(3):
        client.get("/v1/pets", headers=bearer(other))  # 2 strikes, no ban
    for _ in range(4):
        client.get("/v1/pets", headers=bearer(key))  # 3 strikes: banned, then a new count
    client.get("/v1/rate_limit", headers=bearer(key))
    assert standing(client, key)["ban"] is not None
    redis_client = redis.Redis.from_url(redis_url)
    strikes_key = "LIMITS:fixed-window/strikes/2"
    redis_client.set(strikes_key, 2)  # as if it had struck again since
    assert standing(client, key)["strikes"]["count"] == 2

    environ = {"DATABASE_URL": database_url, "RATELIMIT_STORAGE_URI": redis_url}
    result = CliRunner().invoke(main, ["bans", "lift", "2"], env=environ)

    assert result.exit_code == 0, result.output
    assert result.output == "lifted the ban of key 2 and cleared its strikes\n"
    pass_key_cache_bound(client.application)
    after = standing(client, key)
    assert after["ban"] is None and after["strikes"]["count"] == 0
    assert standing(client, other)["strikes"]["count"] == 2
