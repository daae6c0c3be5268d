"""The limiter storages of petstore.storages: counts, expiries, the memory sweep, and the URIs."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from petstore import storages


def test_uris_map_to_our_storages() -> None:
    assert storages.storage_uri("memory://") == "petstore+memory://"
    assert storages.storage_uri("redis://h:1/2") == "petstore+redis://h:1/2"
    assert storages.storage_uri("memcached://h:1") == "memcached://h:1"


def test_memory_counts_and_starts_a_new_window_when_one_ends() -> None:
    storage = storages.SweepingMemoryStorage()
    assert [storage.incr("k", 1) for _ in range(3)] == [1, 2, 3]
    assert storage.get("k") == 3
    assert time.time() < storage.get_expiry("k") <= time.time() + 1
    storage.expirations["k"] = time.time() - 0.001  # the window has ended
    assert storage.incr("k", 1) == 1


def test_memory_sweeps_ended_windows_without_a_timer_thread() -> None:
    storage = storages.SweepingMemoryStorage()
    storage.incr("old", 1)
    storage.incr("new", 60)
    storage.sweep(time.time() + 2)
    assert "old" not in storage.storage and "old" not in storage.expirations
    assert storage.storage["new"] == 1
    storage.next_sweep = 0  # due: the next increment sweeps first
    storage.expirations["new"] = time.time() - 0.001
    storage.incr("other", 60)
    assert "new" not in storage.storage


@pytest.fixture
def counting(redis_url: str) -> storages.CountingRedisStorage:
    return storages.CountingRedisStorage("petstore+" + redis_url)


def test_redis_increment_remembers_count_and_expiry(
    counting: storages.CountingRedisStorage, redis_url: str
) -> None:
    assert [counting.incr("k", 60) for _ in range(3)] == [1, 2, 3]
    assert counting.get("k") == 3
    expiry = counting.get_expiry("k")
    assert time.time() + 58 < expiry <= time.time() + 60
    # What it remembers is what Redis holds: a fresh read agrees.
    counting.forget()
    assert counting.get("k") == 3
    assert abs(counting.get_expiry("k") - expiry) < 2
    server = redis.Redis.from_url(redis_url)
    assert 58 <= server.ttl("LIMITS:k") <= 60


def test_redis_memory_is_per_thread_and_ends_with_the_request(
    counting: storages.CountingRedisStorage, redis_url: str
) -> None:
    counting.incr("k", 60)
    redis.Redis.from_url(redis_url).set("LIMITS:k", 10, keepttl=True)
    assert counting.get("k") == 1  # this request's own count, no round trip
    seen_elsewhere: list[int] = []
    other = threading.Thread(target=lambda: seen_elsewhere.append(counting.get("k")))
    other.start()
    other.join(timeout=10)
    assert seen_elsewhere == [10]
    counting.forget()
    assert counting.get("k") == 10
    counting.clear("k")
    assert counting.get("k") == 0
