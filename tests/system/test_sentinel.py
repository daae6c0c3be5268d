"""redis+sentinel://: a master, a replica and three sentinels on loopback; the master killed under load."""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from petstore import config, db, keys, migrations
from petstore.ratelimit import storages
from tests.support.checks import Answer, call
from tests.support.databases import empty_database
from tests.support.redis_servers import (
    RedisReplica,
    RedisSentinel,
    RedisServer,
    redis_command,
    redis_fields,
)
from tests.support.servers import Gunicorn, poll_until

SERVICE = "petstore"
CLIENTS = 8
HTTP_TIMEOUT = 15.0
# Sentinel: 1 s without an answer is down; then a vote and the promotion.
PROMOTED_WITHIN = 30.0
# flask-limiter tries the storage again after 1, 2, 4, 8, 16 s of fallback.
BACK_ON_REDIS_WITHIN = 45.0
# No answer may take longer than a Redis timeout or two and the request itself: no hang.
LONGEST_ANSWER = 5.0


@dataclass
class Topology:
    """The servers of the test, and the service's storage URI."""

    master: RedisServer
    replica: RedisReplica
    sentinels: list[RedisSentinel]
    database_url: str
    workdir: Path

    @property
    def storage_uri(self) -> str:
        hosts = ",".join(f"127.0.0.1:{sentinel.port}" for sentinel in self.sentinels)
        return f"redis+sentinel://{hosts}/{SERVICE}"

    def connect(self) -> db.Connection:
        return db.connect(config.from_environ({"DATABASE_URL": self.database_url}))

    def issue(self, per_minute: int = 10_000_000) -> tuple[str, int]:
        with self.connect() as conn:
            key, row = keys.issue_key(conn, "enterprise", "sentinel", per_minute, 100_000_000)
        return key, int(row["id"])


def settled(topology: Topology) -> bool:
    """Every sentinel sees the replica and the two other sentinels, and the replica is in sync."""
    for sentinel in topology.sentinels:
        known = sentinel.master()
        if known.get("num-other-sentinels") != "2" or known.get("num-slaves") != "1":
            return False
    info = redis_fields(redis_command(topology.replica.port, "INFO", "replication"))
    return info.get("master_link_status") == "up"


@pytest.fixture(scope="module")
def topology(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    """A migrated scratch database; a master, its replica and three sentinels, settled (bounded)."""
    workdir = tmp_path_factory.mktemp("sentinel")
    with empty_database(database_url, "_sentinel") as url:
        with db.connect(config.from_environ({"DATABASE_URL": url})) as conn:
            migrations.upgrade(conn)
        with (
            RedisServer(workdir / "master") as master,
            RedisReplica(workdir / "replica", master.port) as replica,
        ):
            sentinels = [RedisSentinel(workdir / f"sentinel-{n}", master.port) for n in range(3)]
            try:
                for sentinel in sentinels:
                    sentinel.start()
                running = Topology(master, replica, sentinels, url, workdir)
                assert poll_until(lambda: settled(running), bool, within=30.0, interval=0.2), [
                    sentinel.master() for sentinel in sentinels
                ]
                yield running
            finally:
                for sentinel in sentinels:
                    sentinel.stop()


def test_the_sentinel_scheme_counts_in_one_call(topology: Topology) -> None:
    """redis+sentinel:// gets the counting storage (count and expiry in one Lua call) on the master."""
    storage = storages.CountingSentinelStorage(
        storages.storage_uri(topology.storage_uri), socket_timeout=1.0, use_replicas=False
    )
    assert storage.incr("probe", 60) == 1
    count, end = storage.incr_with_expiry("probe", 60)
    assert count == 2 and time.time() < end <= time.time() + 60
    assert storage.get("probe") == 2
    master = redis.Redis(port=topology.master.port)
    assert master.get(storage.prefixed_key("probe")) == b"2"
    assert 0 < master.pttl(storage.prefixed_key("probe")) <= 60_000


def counted(port: int, key_id: int) -> int:
    """The per-minute count of key `key_id` in the Redis on `port` (0 when none)."""
    client = redis.Redis(port=port, socket_timeout=2)
    try:
        total = 0
        for name in client.scan_iter(match=f"*key:{key_id}/*"):
            if re.search(r"/1/minute$", name.decode()):
                total += int(client.get(name) or 0)
        return total
    finally:
        client.close()


def test_master_killed_under_load(topology: Topology) -> None:
    """Requests answer through the failover (fallback), the replica is promoted, counting goes on there."""
    key, _key_id = topology.issue()
    environ = {
        "DATABASE_URL": topology.database_url,
        "RATELIMIT_STORAGE_URI": topology.storage_uri,
        "PETSTORE_REDIS_TIMEOUT": "0.25",
    }
    answers: list[Answer] = []
    failures: list[str] = []
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            try:
                answers.append(
                    call(app.url, "GET", "/v1/pets", headers=auth_header(key), timeout=HTTP_TIMEOUT)
                )
            except OSError as exc:
                failures.append(repr(exc))
                time.sleep(0.2)

    with Gunicorn(environ, topology.workdir / "gunicorn.log") as app:
        threads = [threading.Thread(target=client, daemon=True) for _ in range(CLIENTS)]
        for thread in threads:
            thread.start()
        try:
            time.sleep(1.0)
            killed_at = time.monotonic()
            old_port = topology.master.port
            topology.master.stop()  # SIGKILL, like a crash
            new_port = poll_until(
                lambda: topology.sentinels[0].master_port_now(),
                lambda port: port not in (None, old_port),
                within=PROMOTED_WITHIN,
                interval=0.2,
            )
            promoted_after = time.monotonic() - killed_at
            assert new_port == topology.replica.port, f"no promotion within {PROMOTED_WITHIN} s"
            back_after = wait_until_counting_on(app, topology, new_port)
            during = [a for a in answers if a.started >= killed_at]
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=HTTP_TIMEOUT + 5)
    statuses = Counter(answer.status for answer in during)
    longest = max(answer.elapsed for answer in during)
    print(
        f"\nSentinel failover: {len(during)} requests from the kill until every worker counted "
        f"on the new master, statuses {dict(statuses)}, longest answer {longest:.3f} s, "
        f"promoted after {promoted_after:.1f} s, counting on the new master after "
        f"{back_after:.1f} s"
    )
    assert not failures, failures[:5]
    assert not [thread for thread in threads if thread.is_alive()]
    assert set(Counter(answer.status for answer in answers)) == {200}, statuses
    assert len(during) >= 50, "too little load during the failover to prove anything"
    assert longest < LONGEST_ANSWER


def auth_header(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", "Connection": "close"}


def wait_until_counting_on(app: Gunicorn, topology: Topology, port: int) -> float:
    """Seconds from now until every worker that fell back is back on Redis and counts on `port` exactly.

    flask-limiter logs each fallback and each recovery, once per worker.
    """
    started = time.monotonic()
    deadline = started + BACK_ON_REDIS_WITHIN
    burst = 16
    while time.monotonic() < deadline:
        key, key_id = topology.issue()
        with ThreadPoolExecutor(max_workers=CLIENTS) as executor:
            statuses = [
                future.result().status
                for future in [
                    executor.submit(call, app.url, "GET", "/v1/pets", headers=auth_header(key))
                    for _ in range(burst)
                ]
            ]
        assert set(statuses) == {200}, statuses
        log = app.log_path.read_text(encoding="utf-8")
        fell_back = log.count("falling back to in-memory storage")
        recovered = log.count("Rate limit storage recovered")
        if fell_back and recovered == fell_back and counted(port, key_id) == burst:
            return time.monotonic() - started
        time.sleep(0.5)
    pytest.fail(f"the service did not count on the new master within {BACK_ON_REDIS_WITHIN} s")
