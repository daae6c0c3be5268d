"""redis+cluster://: three masters on loopback, created by the test; exact limits, strikes and bans."""

from __future__ import annotations

import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis.cluster

from petstore import config, db, keys, migrations
from petstore.ratelimit import storages
from tests.support.checks import call
from tests.support.databases import empty_database
from tests.support.programs import program
from tests.support.redis_servers import RedisClusterNode, redis_command, redis_fields
from tests.support.servers import Gunicorn, poll_until

NODES = 3
FREE_PER_MINUTE = 60
REQUESTS = 100
BAN_THRESHOLD = 10


def cluster_ok(nodes: list[RedisClusterNode]) -> bool:
    """Every node says the cluster is ok, with every slot served."""
    for node in nodes:
        info = redis_fields(redis_command(node.port, "CLUSTER", "INFO"))
        if info.get("cluster_state") != "ok" or info.get("cluster_slots_ok") != "16384":
            return False
    return True


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RedisClusterNode]]:
    """Three masters joined with `redis-cli --cluster create`, waited for (bounded)."""
    workdir = tmp_path_factory.mktemp("cluster")
    nodes = [RedisClusterNode(workdir / f"node-{n}") for n in range(NODES)]
    try:
        for node in nodes:
            node.start()
        created = subprocess.run(
            [
                program("redis-cli"),
                "--cluster",
                "create",
                *(f"127.0.0.1:{node.port}" for node in nodes),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert created.returncode == 0, created.stdout + created.stderr
        assert poll_until(lambda: cluster_ok(nodes), bool, within=30.0, interval=0.2)
        yield nodes
    finally:
        for node in nodes:
            node.stop()


@pytest.fixture(scope="module")
def scratch_url(database_url: str) -> Iterator[str]:
    """A migrated scratch database of this module."""
    with empty_database(database_url, "_cluster") as url:
        with db.connect(config.from_environ({"DATABASE_URL": url})) as conn:
            migrations.upgrade(conn)
        yield url


def storage_uri(nodes: list[RedisClusterNode]) -> str:
    return "redis+cluster://" + ",".join(f"127.0.0.1:{node.port}" for node in nodes)


def test_the_cluster_scheme_counts_in_one_call(cluster: list[RedisClusterNode]) -> None:
    """redis+cluster:// gets the counting storage: count and expiry from one Lua call, on the key's node."""
    storage = storages.CountingClusterStorage(
        storages.storage_uri(storage_uri(cluster)), socket_timeout=1.0
    )
    for n in range(1, 4):
        assert storage.incr(f"probe/{n}", 60) == 1
    count, end = storage.incr_with_expiry("probe/1", 60)
    assert count == 2 and time.time() < end <= time.time() + 60
    assert storage.get("probe/1") == 2
    client = redis.cluster.RedisCluster(host="127.0.0.1", port=cluster[0].port)
    try:
        assert client.get(storage.prefixed_key("probe/1")) == b"2"
        assert 0 < client.pttl(storage.prefixed_key("probe/1")) <= 60_000
    finally:
        client.close()


def test_a_lease_is_reserved_and_given_back_window_by_window(
    cluster: list[RedisClusterNode],
) -> None:
    """A lease's windows may live on different nodes: each grants at most what the one before it
    did, the earlier ones get back the difference, and a spent window grants nothing."""
    storage = storages.CountingClusterStorage(
        storages.storage_uri(storage_uri(cluster)), socket_timeout=1.0
    )
    windows = [("lease/minute", 60, 100), ("lease/day", 600, 30)]
    assert len({storage.prefixed_key(key) for key, _, _ in windows}) == 2
    leased = storage.reserve_windows(windows, 80, 2)
    # The minute grants 50 (what is left over 2 workers), the day 15: the minute gets 35 back.
    assert leased.granted == 15
    assert [storage.get(key) for key, _, _ in windows] == [15, 15]
    storage.release_windows(windows, 5, [end for _count, end in leased.counted])
    assert [storage.get(key) for key, _, _ in windows] == [10, 10]
    granted = [storage.reserve_windows(windows, 80, 2).granted for _ in range(12)]
    assert sum(granted) == 20 and granted[-1] == 0, granted
    assert [storage.get(key) for key, _, _ in windows] == [30, 30]


def test_limits_are_exact_across_workers_and_bans_hold(
    cluster: list[RedisClusterNode], scratch_url: str, tmp_path: Path
) -> None:
    """100 concurrent requests of a free key through 2 workers × 4 threads: exactly 60 × 200, then a ban."""
    with db.connect(config.from_environ({"DATABASE_URL": scratch_url})) as conn:
        key, row = keys.issue_key(conn, "free", "cluster", None, None)
    environ = {
        "DATABASE_URL": scratch_url,
        "RATELIMIT_STORAGE_URI": storage_uri(cluster),
        "PETSTORE_BAN_THRESHOLD": str(BAN_THRESHOLD),
    }
    headers = {"Authorization": f"Bearer {key}", "Connection": "close"}
    with Gunicorn(environ, tmp_path / "gunicorn.log") as app:
        with ThreadPoolExecutor(max_workers=16) as executor:
            futures = [
                executor.submit(call, app.url, "GET", "/v1/pets", headers=headers)
                for _ in range(REQUESTS)
            ]
            answers = [future.result() for future in futures]
        statuses = Counter(answer.status for answer in answers)
        assert statuses == {200: FREE_PER_MINUTE, 429: REQUESTS - FREE_PER_MINUTE}, statuses
        codes = Counter(answer.body["code"] for answer in answers if answer.status == 429)
        assert codes["rate_limited"] >= BAN_THRESHOLD, codes
        after = call(app.url, "GET", "/v1/pets", headers=headers)
        assert after.status == 429 and after.body["code"] == "api_key_banned", after.body
        # Counted in the cluster all along: the in-memory fallback would count per worker.
        assert "falling back" not in app.log_path.read_text(encoding="utf-8")
    with db.connect(config.from_environ({"DATABASE_URL": scratch_url})) as conn:
        bans = conn.execute("select count(*) as n from bans where key_id = %s", [row["id"]])
        assert bans.fetchone() == {"n": 1}
