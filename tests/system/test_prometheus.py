"""GET /metrics scraped by a real Prometheus: two gunicorn workers summed, known traffic, PromQL answers."""

from __future__ import annotations

import importlib.metadata
import math
import os
import shutil
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.multiprocess import MultiProcessCollector

from petstore import config, db, metrics, openapi, views
from tests.support.checks import call
from tests.support.nginx import DeployedGunicorn, Nginx
from tests.support.prometheus import ALERTS, SCRAPE_CONFIG, Prometheus, binary
from tests.support.servers import poll_until

ROOT = Path(__file__).resolve().parents[2]
ALERTS_TEST = Path(__file__).resolve().parent / "alerts_test.yml"
THREADS = 2  # per worker, and so connections per worker's pool
WORKERS = 2
BURST_PER_MINUTE = 5
LATENCY = "petstore_http_request_duration_seconds"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def new_pet(n: int) -> dict[str, Any]:
    return {"name": f"pet-{n}", "categoryId": 1, "status": "available"}


def show(prometheus: Prometheus, promql: str) -> float | None:
    """The query's value, printed as the test's record of what Prometheus answered."""
    value = prometheus.value(promql)
    print(f"PromQL  {promql}\n  =>    {value}")
    return value


def pool_size_in(gauge_file: Path) -> float | None:
    """The petstore_db_pool_size one worker wrote in its own file, None before it has one."""
    if not gauge_file.exists():
        return None
    for family in MultiProcessCollector.merge([str(gauge_file)]):
        for sample in family.samples:
            if sample.name == "petstore_db_pool_size":
                return float(sample.value)
    return None


def send_known_traffic(url: str, key: str, burst_key: str) -> None:
    """30 listPets, 5 createPet (the last with an Idempotency-Key, then replayed), 3 bad bodies,
    one getPet and one unrouted 404, and a burst of 8 listPets by a 5/minute key into 429s and a ban."""
    for _ in range(30):
        assert call(url, "GET", "/v1/pets?limit=5", headers=bearer(key)).status == 200
    for n in range(5):
        headers = bearer(key) | ({"Idempotency-Key": "metrics-test"} if n == 4 else {})
        assert call(url, "POST", "/v1/pets", headers=headers, json_body=new_pet(n)).status == 201
    replayed = call(
        url,
        "POST",
        "/v1/pets",
        headers=bearer(key) | {"Idempotency-Key": "metrics-test"},
        json_body=new_pet(4),
    )
    assert (replayed.status, replayed.header("Idempotent-Replayed")) == (201, "true")
    for bad in (b"{not json", b'{"name": ""}', b'{"name": "x", "categoryId": 1, "id": 7}'):
        answer = call(
            url,
            "POST",
            "/v1/pets",
            headers=bearer(key) | {"Content-Type": "application/json"},
            body=bad,
        )
        assert answer.status == 400, answer.body
    assert call(url, "GET", "/v1/pets/999999", headers=bearer(key)).status == 404
    assert call(url, "GET", "/v1/nope/123", headers=bearer(key)).status == 404
    burst = [call(url, "GET", "/v1/pets", headers=bearer(burst_key)) for _ in range(8)]
    codes = [a.body["code"] if a.status == 429 else a.status for a in burst]
    # 5 within the budget, 2 strikes (the second bans), then the ban itself.
    assert codes == [200] * 5 + ["rate_limited"] * 2 + ["api_key_banned"], codes


def test_prometheus_sums_two_workers_of_known_traffic(
    database_url: str,
    redis_url: str,
    conn: db.Connection,
    issue_key: Callable[..., str],
    tmp_path: Path,
) -> None:
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    stale = metrics_dir / "counter_999999999.db"
    stale.write_bytes(b"left by an earlier run")
    environ = {
        "DATABASE_URL": database_url,
        "RATELIMIT_STORAGE_URI": redis_url,
        "PETSTORE_BAN_THRESHOLD": "2",
        "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),
    }
    key = issue_key("pro")
    burst_key = issue_key("free", per_minute=BURST_PER_MINUTE)
    with (
        DeployedGunicorn(
            environ, tmp_path / "gunicorn.log", workers=WORKERS, threads=THREADS
        ) as server,
        Prometheus([server.address], tmp_path / "prometheus") as prometheus,
    ):
        assert not stale.exists(), "the master empties the metrics directory at start"
        # Scraped once before the traffic, so that rate() sees it start from zero.
        listed = f'sum({LATENCY}_count{{operation="listPets"}})'
        assert prometheus.wait_value(listed, 0.0) == 0.0, prometheus.log()

        send_known_traffic(server.url, key, burst_key)

        requests = 'sum(petstore_http_requests_total{{operation="{}",status="{}"}})'
        assert prometheus.wait_value(requests.format("listPets", 200), 35.0) == 35.0
        expected = {
            requests.format("listPets", 200): 35.0,
            requests.format("listPets", 429): 3.0,
            requests.format("createPet", 201): 6.0,
            requests.format("createPet", 400): 3.0,
            requests.format("getPet", 404): 1.0,
            requests.format("unknown", 404): 1.0,
            'sum(petstore_too_many_requests_total{code="rate_limited"})': 2.0,
            'sum(petstore_too_many_requests_total{code="api_key_banned"})': 1.0,
            "sum(petstore_bans_created_total)": 1.0,
            "sum(petstore_idempotent_replays_total)": 1.0,
            listed: 38.0,
            f'sum({LATENCY}_bucket{{operation="listPets",le="+Inf"}})': 38.0,
            "sum(petstore_database_errors_total)": 0.0,
            "sum(petstore_ratelimit_storage_errors_total)": 0.0,
            "sum(petstore_ratelimit_storage_fallback)": 0.0,
            # Every worker's pool, summed: each one samples its own every second.
            "sum(petstore_db_pool_size)": float(WORKERS * THREADS),
            "sum(petstore_db_pool_requests_waiting)": 0.0,
            'up{job="petstore"}': 1.0,
        }
        # Each worker writes its tally every second, and Prometheus scrapes every second.
        answers = poll_until(
            lambda: {promql: prometheus.value(promql) for promql in expected},
            lambda got: got == expected,
            20.0,
            0.25,
        )
        for promql in expected:
            show(prometheus, promql)
        assert answers == expected
        in_use = "sum(petstore_db_pool_connections_in_use)"
        assert prometheus.wait_value(in_use, 0.0) == 0.0

        rate = show(prometheus, f'sum(rate({LATENCY}_count{{operation="listPets"}}[1m]))')
        assert rate is not None and rate > 0
        # increase() extrapolates to the window's edges: never below what was counted.
        increase = show(prometheus, f'sum(increase({LATENCY}_count{{operation="listPets"}}[5m]))')
        assert increase is not None and increase >= 38.0 - 1e-9
        median = show(
            prometheus,
            "histogram_quantile(0.5, sum by (le) "
            f'(rate({LATENCY}_bucket{{operation="listPets"}}[1m])))',
        )
        assert median is not None and math.isfinite(median) and 0 < median <= 10.0

        operations = {
            series["metric"]["operation"]
            for series in prometheus.query("count by (operation) (petstore_http_requests_total)")
        }
        document = openapi.build_document(config.from_environ(), views.RESOURCES)
        operation_ids = [
            op["operationId"] for ops in document["paths"].values() for op in ops.values()
        ]
        known = {*operation_ids, *metrics.OTHER_ENDPOINTS.values(), metrics.UNKNOWN}
        assert operations <= known, operations
        (info,) = prometheus.query("petstore_build_info")
        assert info["metric"]["version"] == importlib.metadata.version("petstore")
        assert info["metric"]["getpet_sunset"] == "2030-12-05"

        text = call(server.url, "GET", "/metrics").raw.decode()
        for secret in (key, burst_key, "/v1/pets/999999", "nope", "metrics-test"):
            assert secret not in text

        # A worker dies: gunicorn replaces it, child_exit drops its gauges, its counters stay.
        before = server.wait_for_workers()
        dead = before[0]
        os.kill(dead, signal.SIGKILL)
        lingering = poll_until(
            lambda: sorted(metrics_dir.glob(f"gauge_live*_{dead}.db")), lambda x: not x, 20.0
        )
        assert not lingering, "child_exit removes a dead worker's live gauges"
        workers = poll_until(
            lambda: [pid for pid in server.worker_pids() if pid != dead],
            lambda pids: len(pids) == WORKERS,
            20.0,
        )
        (newcomer,) = set(workers) - set(before)
        # Wait until the new worker has sampled its own pool into its file.
        sampled = poll_until(
            lambda: pool_size_in(metrics_dir / f"gauge_livesum_{newcomer}.db"),
            lambda size: size == THREADS,
            20.0,
        )
        assert sampled == THREADS, server.log()
        # Two workers' pools, not three: a lingering file of the dead one would make it 6.
        pool = "sum(petstore_db_pool_size)"
        assert prometheus.wait_value(pool, float(WORKERS * THREADS)) == WORKERS * THREADS
        # Each live worker's process numbers, by pid; the dead one's went with its file.
        by_pid = "count by (pid) (petstore_worker_resident_memory_bytes)"
        pids = poll_until(
            lambda: {series["metric"]["pid"] for series in prometheus.query(by_pid)},
            lambda got: got == {str(pid) for pid in workers},
            20.0,
        )
        assert pids == {str(pid) for pid in workers}
        assert show(prometheus, requests.format("listPets", 200)) == 35.0


def test_nginx_hides_metrics_from_clients(
    database_url: str, redis_url: str, conn: db.Connection, tmp_path: Path
) -> None:
    """Through the shipped site /metrics is the Error 404; on the instance itself it answers."""
    # No PROMETHEUS_MULTIPROC_DIR: the shipped gunicorn config makes a directory of its own.
    environ = {"DATABASE_URL": database_url, "RATELIMIT_STORAGE_URI": redis_url}
    with (
        DeployedGunicorn(environ, tmp_path / "gunicorn.log") as server,
        Nginx([server.address], tmp_path / "nginx", workers=1) as proxy,
    ):
        direct = call(server.url, "GET", "/metrics")
        assert direct.status == 200
        assert (direct.header("content-type") or "").startswith("text/plain; version=")
        assert "petstore_build_info{" in direct.raw.decode()
        for path in ("/metrics", "/metrics?x=1", "//metrics", "/%6Detrics"):
            hidden = call(proxy.url, "GET", path)
            assert hidden.status == 404 and hidden.is_json_error, (path, hidden)
            assert hidden.body["code"] == "not_found"
        # A request that is logged, as a marker that the log is written up to here.
        marker = call(server.url, "GET", "/v1/pets")
        assert server.logged([marker.headers["x-request-id"]]), "the app did not log the marker"
        records = [r for r in server.records() if r.get("logger") == "petstore.access"]
        assert not [r for r in records if r.get("path") == "/metrics"], "logged at debug only"


@pytest.mark.parametrize(
    "command",
    [
        ["check", "config", str(SCRAPE_CONFIG)],
        ["check", "rules", str(ALERTS)],
        ["test", "rules", str(ALERTS_TEST)],
    ],
    ids=["config", "rules", "rule-tests"],
)
def test_promtool_accepts_the_shipped_files(command: list[str]) -> None:
    checked = subprocess.run(
        [binary("promtool"), *command], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS" in checked.stdout


def test_promtool_accepts_the_kubernetes_scrape_config_beside_the_rules(tmp_path: Path) -> None:
    """deploy/k8s/prometheus.yml in one directory with deploy/alerts.yml, as a Prometheus in the
    cluster reads them (docs/deploying.rst, "On Kubernetes"); its discovery needs a cluster."""
    for shipped in (ROOT / "deploy" / "k8s" / "prometheus.yml", ALERTS):
        shutil.copy(shipped, tmp_path / shipped.name)
    checked = subprocess.run(
        [binary("promtool"), "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 1 rule files found" in checked.stdout


def test_a_start_removes_the_metrics_directory_a_killed_master_left_and_only_that(
    database_url: str, redis_url: str, conn: db.Connection, tmp_path: Path
) -> None:
    """kill -9 leaves the master's own directory behind (its clean-up never runs); the next start
    removes it, and keeps a running instance's and one whose name has no pid."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    # No PROMETHEUS_MULTIPROC_DIR: each master makes its own, in TMPDIR.
    environ = {"DATABASE_URL": database_url, "RATELIMIT_STORAGE_URI": redis_url, "TMPDIR": str(tmp)}
    unnamed = tmp / "petstore-metrics-k2x9_q0a"  # as an earlier release named them: kept
    unnamed.mkdir()
    with DeployedGunicorn(environ, tmp_path / "running.log", workers=1, threads=1) as running:
        (running_dir,) = tmp.glob(f"petstore-metrics-{running.pid}-*")
        with DeployedGunicorn(environ, tmp_path / "killed.log", workers=1, threads=1) as killed:
            (left,) = tmp.glob(f"petstore-metrics-{killed.pid}-*")
            assert killed.process is not None
            os.kill(killed.pid, signal.SIGKILL)
            killed.process.wait(timeout=10)
        # Its workers are gone too (stop() kills its process group); its directory stays.
        assert left.exists() and any(left.glob("*.db"))
        with DeployedGunicorn(environ, tmp_path / "again.log", workers=1, threads=1) as again:
            (own,) = tmp.glob(f"petstore-metrics-{again.pid}-*")
            assert not left.exists(), "the next start removes a dead master's directory"
            assert running_dir.exists() and unnamed.exists()
            scrape = call(running.url, "GET", "/metrics")
            assert scrape.status == 200 and "petstore_build_info{" in scrape.raw.decode()
        assert not own.exists()
    assert sorted(tmp.iterdir()) == [unnamed]
