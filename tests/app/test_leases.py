"""Leased budgets (petstore.ratelimit.leases) against the test Redis: simulated workers in one
process, a seeded interleaving, the issue's bounds for a hot key (calls, never above the limit,
refusing early by little) and a cold key unchanged; a pause, a worker killed holding a lease,
releases, heartbeats, the fallback's share, strikes in batches and a ban through the app."""

from __future__ import annotations

import itertools
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis
from flask import Flask
from limits import RateLimitItemPerMinute, RateLimitItemPerSecond

from petstore import db
from petstore.ratelimit import storages
from petstore.ratelimit.bans import Tallies
from petstore.ratelimit.leases import LEASE_SECONDS, Leases, Result
from petstore.ratelimit.limiter import shares
from tests.support.checks import assert_error

HOT_RATE = 5
IDLE_SECONDS = 1.0
WORKERS = 4
# The hot key: 1,000 per 5 s (its "minute") and 100,000 per 60 s (its "day"), at 1,200 requests a
# second: six times its limit, as 100 requests a second are for 1,000 a minute.
HOT = (RateLimitItemPerSecond(1000, 5), RateLimitItemPerMinute(100_000))
HOT_PER_SECOND = 1200
COLD = (RateLimitItemPerSecond(1000, 5), RateLimitItemPerMinute(100_000))
COLD_PER_SECOND = 2
SECONDS = 16.0


class CountingStorage(storages.CountingRedisStorage):
    """The storage, counting the scripts it runs and the budgets they name."""

    def __init__(self, uri: str) -> None:
        super().__init__(uri)
        self.calls: Counter[tuple[str, str]] = Counter()
        self.names = {
            self.lua_incr_windows.sha: "incr",
            self.lua_reserve_windows.sha: "reserve",
            self.lua_release_windows.sha: "release",
            self.lua_workers.sha: "workers",
        }

    def call(self, script: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        who = next((part for part in keys[0].split("/") if part.startswith("key:")), "")
        self.calls[(self.names.get(script.sha, "other"), who)] += 1
        return super().call(script, keys, args)


def worker(redis_url: str, name: str) -> Leases:
    """One simulated worker: its own storage connection, its own leases."""
    storage = CountingStorage("petstore+" + redis_url)
    return Leases(storage, HOT_RATE, IDLE_SECONDS, "fixed-window/workers", name=name)


@pytest.fixture
def workers(redis_url: str) -> Iterator[list[Leases]]:
    made = [worker(redis_url, f"/w{number}") for number in range(WORKERS)]
    yield made
    for leases in made:
        leases.give_back_all()


@dataclass
class Answer:
    who: str
    at: float
    results: list[Result]

    @property
    def admitted(self) -> bool:
        return all(allowed for allowed, _remaining, _reset in self.results)


@dataclass
class Window:
    """Answers of one window of a budget's first limit, grouped by the end they carry."""

    end: float
    answers: list[Answer] = field(default_factory=list)

    @property
    def admitted(self) -> int:
        return sum(answer.admitted for answer in self.answers)


def run(workers: list[Leases], loads: dict[str, tuple[Any, float]], seconds: float) -> list[Answer]:
    """Open loop: each budget's requests at its rate, each to a worker chosen by a seeded draw."""
    chooser = random.Random(39)
    events = sorted(
        (number / rate, who)
        for who, (_items, rate) in loads.items()
        for number in range(int(seconds * rate))
    )
    answers = []
    start = time.monotonic()
    for offset, who in events:
        wait = start + offset - time.monotonic()
        if wait > 0.001:
            time.sleep(wait)
        items, _rate = loads[who]
        leases = chooser.choice(workers)
        results = leases.count(items, ("fixed-window", who, "global"))
        answers.append(Answer(who, time.time(), results))
    return answers


def windows_of(answers: list[Answer], who: str) -> list[Window]:
    """The budget's answers by the window of its first limit (ends within a second: one window)."""
    found: list[Window] = []
    for answer in answers:
        if answer.who != who:
            continue
        end = answer.results[0][2]
        if not found or abs(found[-1].end - end) > 1.0:
            found.append(Window(end))
        found[-1].answers.append(answer)
    return found


def calls(workers: list[Leases], who: str) -> Counter[str]:
    """Every worker's storage calls that name the budget, by script."""
    total: Counter[str] = Counter()
    for leases in workers:
        for (script, named), count in leases.storage.calls.items():
            if named == who:
                total[script] += count
    return total


def test_a_hot_key_never_passes_its_limit_refuses_early_by_little_and_rarely_calls_redis(
    workers: list[Leases], redis_url: str
) -> None:
    answers = run(
        workers,
        {"key:1": (HOT, HOT_PER_SECOND), "key:2": (COLD, COLD_PER_SECOND)},
        SECONDS,
    )
    hot = windows_of(answers, "key:1")
    limit = HOT[0].amount
    # (b) never above the limit; and no answer shows more remaining than really remains.
    for window in hot:
        assert window.admitted <= limit, (window.end, window.admitted)
        admitted = 0
        for answer in window.answers:
            if answer.admitted:
                admitted += 1
                assert answer.results[0][1] <= limit - admitted, answer
        ends = [answer.results[0][2] for answer in window.answers]
        assert max(ends) - min(ends) < 0.2, "one window, one end"
    # (c) every window that started and ended inside the run refuses early by at most 2 x workers.
    full = hot[1:-1]
    assert len(full) >= 2, [window.end for window in hot]
    for window in full:
        assert window.admitted >= limit - 2 * WORKERS, (window.end, window.admitted)
    # (a) after the first window (the key's first second is counted request by request): at
    # most 0.02 counting calls per request, 0.10 per admitted request, all calls included.
    steady = [answer for window in hot[1:] for answer in window.answers]
    first = hot[0].answers[-1].at
    spent = calls(workers, "key:1")
    requests = len(steady)
    admitted = sum(answer.admitted for answer in steady)
    assert spent["incr"] <= sum(1 for answer in hot[0].answers), spent
    counting = spent["reserve"]
    assert counting / requests <= 0.02, (spent, requests, first)
    assert (counting + spent["release"]) / admitted <= 0.10, (spent, admitted)
    # (d) the cold key: one call per request, never a lease.
    cold = [answer for answer in answers if answer.who == "key:2"]
    assert calls(workers, "key:2") == Counter({"incr": len(cold)})
    assert all(answer.admitted for answer in cold)
    # Every worker knows the others from their heartbeats.
    assert [leases.sharers for leases in workers] == [WORKERS] * WORKERS
    # Idle leases go back: then the long window holds exactly the requests admitted.
    time.sleep(IDLE_SECONDS + 0.5)
    counted = redis.Redis.from_url(redis_url).get(
        "LIMITS:" + HOT[1].key_for("fixed-window", "key:1", "global")
    )
    assert int(counted or 0) == sum(window.admitted for window in hot)


def test_a_burst_shorter_than_a_second_is_counted_request_by_request(
    workers: list[Leases],
) -> None:
    """No lease before a key has come for a second: a burst's count stays exact, in order."""
    items = (RateLimitItemPerMinute(60), RateLimitItemPerMinute(1000))
    answers = [
        workers[number % WORKERS].count(items, ("fixed-window", "key:3", "global"))
        for number in range(100)
    ]
    assert [all(ok for ok, _, _ in answer) for answer in answers] == [True] * 60 + [False] * 40
    assert [answer[0][1] for answer in answers[:60]] == list(range(59, -1, -1))
    assert calls(workers, "key:3") == Counter({"incr": 100})


def test_a_spent_window_is_refused_without_a_call_until_it_ends(workers: list[Leases]) -> None:
    leases = workers[0]
    items = (RateLimitItemPerSecond(30, 10),)
    identifiers = ("fixed-window", "key:4", "global")
    for _ in range(75):  # 50 a second: spent within its first second, hot after it
        leases.count(items, identifiers)
        time.sleep(0.02)
    assert leases.refusing(items, identifiers)
    before = calls(workers, "key:4")
    # Counted request by request for its first second, then one lease asked for, and refused.
    assert set(before) == {"incr", "reserve"} and before["reserve"] == 1, before
    assert 30 < before["incr"] < 75, before
    refusals = [leases.count(items, identifiers) for _ in range(100)]
    assert all(answer == [(False, 0, refusals[0][0][2])] for answer in refusals)
    assert calls(workers, "key:4") == before, "a remembered refusal makes no call"


def heat(leases: Leases, items: tuple[Any, ...], identifiers: tuple[str, ...]) -> None:
    """50 requests a second for 1.5 s: the key is hot in this worker, and leasing."""
    for _ in range(75):
        leases.count(items, identifiers)
        time.sleep(0.02)


def test_a_pause_in_the_window_leased_from_costs_one_call(workers: list[Leases]) -> None:
    """A busy key that a worker gets in bursts: after a gap, one exact count, then leases again."""
    leases = workers[0]
    items = (RateLimitItemPerMinute(10_000),)
    identifiers = ("fixed-window", "key:5", "global")
    heat(leases, items, identifiers)
    assert calls(workers, "key:5")["reserve"] >= 1
    time.sleep(1.5)  # a pause: the lease goes back idle, the window goes on
    before = calls(workers, "key:5")
    after_pause = leases.count(items, identifiers)
    assert calls(workers, "key:5") - before == Counter({"incr": 1})
    assert after_pause[0][0] and after_pause[0][1] < 10_000
    for _ in range(20):
        leases.count(items, identifiers)
        time.sleep(0.02)
    spent = calls(workers, "key:5") - before
    # Leases again at once, sized by the rate since the pause (so the first ones are small).
    assert spent["incr"] == 1 and 1 <= spent["reserve"] <= 5, spent


def test_a_pause_past_a_new_window_counts_request_by_request_again(
    redis_url: str, workers: list[Leases]
) -> None:
    """A storage emptied during the pause (as between tests) has a new window: the paused key is
    counted exactly again, request by request, until it has come for a second."""
    leases = workers[0]
    items = (RateLimitItemPerMinute(1000),)
    identifiers = ("fixed-window", "key:6", "global")
    heat(leases, items, identifiers)
    time.sleep(1.5)
    server = redis.Redis.from_url(redis_url)
    server.delete("LIMITS:" + items[0].key_for(*identifiers))
    time.sleep(1.0)  # a new window, its end a second later than the one leased from
    before = calls(workers, "key:6")
    answers = [leases.count(items, identifiers) for _ in range(30)]
    assert calls(workers, "key:6") - before == Counter({"incr": 30})
    assert [answer[0][1] for answer in answers] == list(range(999, 969, -1))


def test_a_worker_killed_holding_a_lease_costs_its_window_that_lease_only(
    workers: list[Leases],
) -> None:
    """SIGKILL gives nothing back: the window refuses early by what the dead worker held, no
    more, and that is at most one lease (two seconds of its rate)."""
    items = (RateLimitItemPerMinute(1000),)
    identifiers = ("fixed-window", "key:7", "global")
    dead, *alive = workers
    heat(dead, items, identifiers)
    held = dead.budgets[(items, identifiers)].tokens
    dead.pid = -1  # killed: its keeper stops at its next sweep, and nothing goes back
    time.sleep(0.5)
    admitted = 75
    refused_in_a_row = 0
    for number in itertools.count():
        answer = alive[number % len(alive)].count(items, identifiers)
        admitted += all(ok for ok, _remaining, _reset in answer)
        refused_in_a_row = 0 if answer[0][0] else refused_in_a_row + 1
        if refused_in_a_row == 3 * len(alive):
            break
    assert 1 <= held <= math.ceil(LEASE_SECONDS * 50), held
    assert admitted == 1000 - held, (admitted, held)


def test_a_hot_key_refused_from_memory_is_banned_at_the_threshold(
    make_app: Callable[..., Flask],
    issue_key: Callable[..., str],
    conn: db.Connection,
    redis_url: str,
) -> None:
    """End to end in one worker: a hot key's window spent, its refusals remembered and their
    strikes tallied; the tally reaching the threshold is counted at once and bans the key."""
    app = make_app(RATELIMIT_STORAGE_URI=redis_url, BAN_THRESHOLD=10, BAN_SECONDS=60)
    client = app.test_client()
    key = issue_key("enterprise", per_minute=100, per_day=100_000)
    headers = {"Authorization": f"Bearer {key}"}
    answers = []
    for _ in range(115):  # 50 a second: hot after a second, spent at the 100th
        answers.append(client.get("/v1/pets?limit=1", headers=headers))
        time.sleep(0.02)
    assert [answer.status_code for answer in answers] == [200] * 100 + [429] * 15
    for answer in answers[100:110]:
        assert_error(answer, 429, "rate_limited")
    assert "now banned for 1 minute" in answers[109].get_json()["message"]
    for answer in answers[110:]:
        assert_error(answer, 429, "api_key_banned")
    (ban,) = conn.execute("select key_id, strikes from bans").fetchall()
    assert ban == {"key_id": 1, "strikes": 10}
    limiter = app.extensions["petstore.limiter"]
    assert limiter.leases is not None
    assert any(budget.refused for budget in limiter.leases.budgets.values()), "not from memory"


def test_unspent_requests_go_back_only_to_the_windows_leased_from(
    redis_url: str, workers: list[Leases]
) -> None:
    storage = workers[0].storage
    windows = [("short", 1, 100), ("long", 60, 1000)]
    leased = storage.reserve_windows(windows, 40, 4)
    assert leased.granted == 25, "a quarter: what is left of 100 over 4 workers"
    assert [count for count, _end in leased.counted] == [25, 25]
    time.sleep(1.2)  # the short window ends; a new one starts
    storage.incr_windows(windows)
    storage.release_windows(windows, 20, [end for _count, end in leased.counted])
    server = redis.Redis.from_url(redis_url)
    assert int(server.get("LIMITS:short") or 0) == 1, "the new window keeps its count"
    assert int(server.get("LIMITS:long") or 0) == 26 - 20
    spent = storage.reserve_windows([("spent", 60, 1)], 5, 1)
    assert spent.granted == 1
    refused = storage.reserve_windows([("spent", 60, 1)], 5, 1)
    assert refused.granted == 0 and refused.counted[0][0] == 1


def test_heartbeats_tell_each_worker_how_many_share_the_limits(workers: list[Leases]) -> None:
    for leases in workers:
        leases.start()
        leases.beat(time.time())
    workers[0].beat(time.time())
    assert workers[0].sharers == WORKERS
    workers[1].beat(time.time(), leave=True)
    workers[0].beat(time.time())
    assert workers[0].sharers == WORKERS - 1


def test_each_worker_counts_its_share_while_the_storage_is_down() -> None:
    items = (RateLimitItemPerMinute(1000), RateLimitItemPerMinute(60))
    assert shares(items, 1) is items
    assert [item.amount for item in shares(items, 4)] == [250, 15]
    assert [item.amount for item in shares(items, 7)] == [143, math.ceil(60 / 7)]


def test_strikes_of_remembered_refusals_are_counted_in_batches() -> None:
    tallies = Tallies()
    now = 1000.0
    # Not due: shown, not counted; due after a second, or at once at the threshold.
    assert [tallies.add(1, 10, now + 0.1 * step) for step in range(3)] == [
        (0, 1),
        (0, 2),
        (0, 3),
    ]
    assert tallies.pending(1) == 3
    assert tallies.add(1, 10, now + 1.0) == (4, 4)
    tallies.counted(1, 4)
    assert tallies.pending(1) == 0
    shown = [tallies.add(1, 10, now + 1.1 + 0.01 * step) for step in range(6)]
    assert shown[:5] == [(0, 5), (0, 6), (0, 7), (0, 8), (0, 9)]
    assert shown[5] == (6, 10), "the threshold reached: counted at once"
