"""The limiter storages of petstore.ratelimit.storages: counts, expiries, the memory sweep, and the URIs."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import redis

from petstore.ratelimit import storages


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


def test_redis_increment_tells_count_and_expiry_in_one_call(
    counting: storages.CountingRedisStorage, redis_url: str
) -> None:
    counted = [counting.incr_with_expiry("k", 60) for _ in range(3)]
    assert [count for count, _ in counted] == [1, 2, 3]
    ends = [end for _, end in counted]
    assert time.time() + 58 < ends[0] <= time.time() + 60
    assert max(ends) - min(ends) < 1, "one window, one end"
    # What it tells is what Redis holds: limits' own reads agree.
    assert counting.get("k") == 3
    assert abs(counting.get_expiry("k") - ends[-1]) < 2
    server = redis.Redis.from_url(redis_url)
    assert 58 <= server.ttl("LIMITS:k") <= 60
    assert counting.incr("k", 60) == 4
    counting.clear("k")
    assert counting.get("k") == 0


def test_redis_counts_every_window_of_a_request_in_one_call(
    counting: storages.CountingRedisStorage, redis_url: str
) -> None:
    calls = []
    call = counting.call

    def counted_call(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return call(*args, **kwargs)

    counting.call = counted_call  # type: ignore[method-assign]
    windows = [("minute", 60, 2), ("day", 86_400, 5)]
    answers = [counting.incr_windows(windows) for _ in range(3)]
    assert len(calls) == 3, "one round trip per request, not one per window"
    assert [[count for count, _end in answer] for answer in answers] == [[1, 1], [2, 2], [3]]
    assert answers[0][0][1] < answers[0][1][1], "each window with its own end"
    server = redis.Redis.from_url(redis_url)
    # Past the minute's limit, the day is not counted: flask-limiter stops at the first limit.
    assert (counting.get("minute"), counting.get("day")) == (3, 2)
    assert 86_390 <= server.ttl("LIMITS:day") <= 86_400


def test_redis_counts_on_a_connection_of_each_thread_and_process(
    counting: storages.CountingRedisStorage,
) -> None:
    counting.incr("k", 60)
    mine = counting.own.conn
    counting.incr("k", 60)
    assert counting.own.conn is mine, "the thread keeps its connection"
    others: list[Any] = []
    thread = threading.Thread(
        target=lambda: others.append((counting.incr("k", 60), counting.own.conn))
    )
    thread.start()
    thread.join()
    assert others[0][0] == 3 and others[0][1] is not mine, "another thread counts on its own"
    counting.own.pid = -1  # as in a forked worker: its parent's socket is not shared
    assert counting.incr("k", 60) == 4
    assert counting.own.conn is not mine


def test_redis_counting_survives_a_cut_connection_and_a_flushed_script(
    counting: storages.CountingRedisStorage, redis_url: str
) -> None:
    assert counting.incr("k", 60) == 1
    server = redis.Redis.from_url(redis_url)
    server.script_flush()
    assert counting.incr("k", 60) == 2, "the script is loaded again"
    conn = counting.own.conn
    assert conn is not None
    conn.send_command("CLIENT", "ID")
    server.client_kill_filter(_id=conn.read_response())
    with pytest.raises(redis.ConnectionError):
        counting.incr("k", 60)  # the limiter counts this one in its fallback
    assert counting.incr("k", 60) == 3, "the next call connects anew"


def test_memory_counts_every_window_up_to_the_first_overdrawn() -> None:
    memory = storages.SweepingMemoryStorage()
    windows = [("minute", 60, 2), ("day", 86_400, 5)]
    answers = [memory.incr_windows(windows) for _ in range(3)]
    assert [[count for count, _end in answer] for answer in answers] == [[1, 1], [2, 2], [3]]
    assert (memory.get("minute"), memory.get("day")) == (3, 2)


def test_memory_increment_tells_count_and_expiry_in_one_call() -> None:
    memory = storages.SweepingMemoryStorage()
    first = memory.incr_with_expiry("k", 1)
    assert first[0] == 1 and time.time() < first[1] <= time.time() + 1
    assert memory.incr_with_expiry("k", 1) == (2, first[1])
    assert (memory.get("k"), memory.get_expiry("k")) == (2, first[1])
    time.sleep(1.05)
    count, end = memory.incr_with_expiry("k", 1)
    assert count == 1 and end > first[1], "a new window after the old one ended"
