"""RateLimit-Policy and RateLimit (draft-ietf-httpapi-ratelimit-headers-10) beside X-RateLimit-*,
read with a structured-field parser (RFC 9651), never a regex."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import http_sf
from flask import Flask
from werkzeug.test import TestResponse

from tests.support.checks import every_status

FIELDS = ("RateLimit-Policy", "RateLimit")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def parsed(response: TestResponse) -> tuple[list[Any], list[Any]]:
    """(policy items, RateLimit items) as the parser reads them: [(name, {param: value})...]."""
    policy = http_sf.parse(response.headers["RateLimit-Policy"].encode(), tltype="list")
    current = http_sf.parse(response.headers["RateLimit"].encode(), tltype="list")
    return policy, current


def assert_agree(response: TestResponse, windows: dict[str, tuple[int, int]]) -> None:
    """Both fields parse, the policy lists `windows` (name -> (quota, seconds)), and RateLimit
    names one of them with the numbers of X-RateLimit-*."""
    policy, current = parsed(response)
    assert {name: (params["q"], params["w"]) for name, params in policy} == windows
    assert [set(params) for _name, params in policy] == [{"q", "w"}] * len(windows)
    ((name, params),) = current
    assert set(params) == {"r", "t"}
    assert windows[name][0] == int(response.headers["X-RateLimit-Limit"])
    assert params["r"] == int(response.headers["X-RateLimit-Remaining"])
    until = int(response.headers["X-RateLimit-Reset"]) - time.time()
    assert 0 <= params["t"] and abs(params["t"] - until) <= 2
    assert params["t"] <= max(seconds for _quota, seconds in windows.values())


def test_every_counted_answer_carries_both_fields_agreeing_with_x_ratelimit(
    make_app: Callable[..., Flask], api_key: str, issue_key: Callable[..., str], conn: Any
) -> None:
    app = make_app()
    client = app.test_client()
    seen = every_status(app, api_key)
    free = {"minute": (60, 60), "day": (1000, 86400)}
    for status, response in seen.items():
        assert response.status_code == status
        assert_agree(response, free)  # the 401 spends the address's budget: 60/minute;1000/day
    assert client.get("/v1/rate_limit", headers=bearer(api_key)).status_code == 200
    assert_agree(client.get("/v1/rate_limit", headers=bearer(api_key)), free)


def test_a_spent_limit_is_the_one_shown(
    make_app: Callable[..., Flask], issue_key: Callable[..., str]
) -> None:
    client = make_app(BAN_THRESHOLD=2).test_client()
    key = issue_key("enterprise", per_minute=2, per_day=100)
    tight = {"minute": (2, 60), "day": (100, 86400)}
    answers = [client.get("/v1/pets", headers=bearer(key)) for _ in range(5)]
    assert [answer.status_code for answer in answers] == [200, 200, 429, 429, 429]
    for answer in answers:
        assert_agree(answer, tight)
    names = [parsed(answer)[1][0][0] for answer in answers]
    # The day has more left at first; once the minute runs out it is the one in force.
    assert names == ["minute"] * 5
    assert [parsed(answer)[1][0][1]["r"] for answer in answers] == [1, 0, 0, 0, 0]


def test_the_day_shows_when_it_has_fewer_left(client: Any, issue_key: Callable[..., str]) -> None:
    key = issue_key("enterprise", per_minute=50, per_day=3)
    answer = client.get("/v1/pets", headers=bearer(key))
    _policy, current = parsed(answer)
    assert current == [("day", {"r": 2, "t": current[0][1]["t"]})]
    assert_agree(answer, {"minute": (50, 60), "day": (3, 86400)})


def test_paths_outside_v1_carry_neither(client: Any) -> None:
    response = client.get("/healthz")
    assert not set(FIELDS) & set(response.headers.keys())


def test_a_banned_key_sees_the_minute_spent_until_the_ban_ends(
    make_app: Callable[..., Flask], issue_key: Callable[..., str]
) -> None:
    client = make_app(BAN_THRESHOLD=1, BAN_SECONDS=600).test_client()
    key = issue_key("enterprise", per_minute=1, per_day=100)
    for _ in range(2):
        client.get("/v1/pets", headers=bearer(key))
    banned = client.get("/v1/pets", headers=bearer(key))
    assert banned.get_json()["code"] == "api_key_banned"

    policy, current = parsed(banned)

    assert [name for name, _params in policy] == ["minute", "day"]
    ((name, params),) = current
    assert (name, params["r"]) == ("minute", 0)
    assert abs(params["t"] - int(banned.headers["Retry-After"])) <= 1
