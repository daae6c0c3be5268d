"""deploy/grafana/petstore.json: every panel's PromQL, and deploy/alerts.yml's, run against a real
Prometheus scraping the service under a small load and the faults that fill the quiet panels."""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
import yaml

from petstore import db
from tests.support.checks import Answer, call
from tests.support.nginx import DeployedGunicorn
from tests.support.prometheus import ALERTS, Prometheus
from tests.support.redis_servers import RedisServer
from tests.support.servers import poll_until

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "petstore.json"
# Grafana's variables, as the test sets them: every instance, and one range that spans the test.
RANGE = "5m"
VARIABLES = {"$__rate_interval": RANGE, "$__interval": RANGE, "$__range": RANGE, "$instance": ".*"}
# The panels whose description says they are zero unless a fault happens ("Zero unless"), and
# how this test causes each fault...
CAUSED = {
    "5xx ratio": "the pets table locked past the statement timeout",
    "Database errors by kind": "the pets table locked past the statement timeout",
    "Statement timeouts": "the pets table locked past the statement timeout",
    "Requests waiting for a connection": "the lock, with 2 threads sharing a pool of 1",
    "429s by code": "a key's burst past its budget",
    "Bans created": "a key calling on after its 429s",
    "Limiter in fallback": "Redis stopped",
    "Redis errors": "Redis stopped",
    "Statement timeout unpinned": "an instance behind a declared pooler, its timeout unpinned",
}
# ... but these, whose faults need a synchronous standby or PgBouncer to fail
# (tests/system/test_synchronous_commit.py and test_pgbouncer.py cause them).
NOT_CAUSED = {"Commits not replicated and lost answers"}
STATEMENT_TIMEOUT_MS = 1000
LOCK_SECONDS = 3.0
# An alert's expression ends in its threshold: with `bool`, it answers 0 or 1 rather than nothing.
THRESHOLD = re.compile(r"\s*(==|!=|>=|<=|>|<)\s*([0-9.]+)\s*$")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def load_dashboard() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return dashboard


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel but the rows (and the panels a collapsed row holds)."""
    found = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            found.extend(panel.get("panels", []))
        else:
            found.append(panel)
    return found


def promql(expr: str) -> str:
    """A target's expression with Grafana's variables replaced."""
    for variable, value in VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"a variable the test does not know: {expr}"
    return expr


def filled(result: list[dict[str, Any]]) -> bool:
    """Whether some series of an instant vector has a value other than zero (NaN aside)."""
    values = [float(series["value"][1]) for series in result]
    return any(math.isfinite(value) and value != 0 for value in values)


def test_the_dashboard_is_grafana_json_on_a_prometheus_variable() -> None:
    """What Grafana's import needs: the data source chosen by a variable, panels on the grid,
    each with a description (the operator's 3 a.m. note) and queries of its own."""
    dashboard = load_dashboard()
    assert dashboard["schemaVersion"] >= 39 and dashboard["uid"] == "petstore"
    assert dashboard["id"] is None, "an id would overwrite another dashboard on import"
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert (variables["datasource"]["type"], variables["datasource"]["query"]) == (
        "datasource",
        "prometheus",
    )
    assert variables["instance"]["allValue"] == VARIABLES["$instance"]
    ids = [panel["id"] for panel in dashboard["panels"]] + [
        inner["id"] for panel in dashboard["panels"] for inner in panel.get("panels", [])
    ]
    assert len(ids) == len(set(ids))
    titles = [panel["title"] for panel in panels(dashboard)]
    assert len(titles) == len(set(titles))
    for panel in panels(dashboard):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
        assert len(panel["description"]) > 40, panel["title"]
        refs = [target["refId"] for target in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"] and target["expr"], panel["title"]
    # docs/monitoring.rst says what each panel means.
    manual = (ROOT / "docs" / "monitoring.rst").read_text(encoding="utf-8")
    assert [title for title in titles if f"``{title}``" not in manual] == []
    # Exactly the panels the test knows as quiet say so.
    quiet = {panel["title"] for panel in panels(dashboard) if "Zero unless" in panel["description"]}
    assert quiet == set(CAUSED) | NOT_CAUSED


def send_traffic(url: str, key: str, burst_key: str) -> None:
    """Lists, creates, a get, a bad body, an unrouted 404, and a burst into 429s and a ban."""
    created = []
    for n in range(5):
        answer = call(
            url,
            "POST",
            "/v1/pets",
            headers=bearer(key),
            json_body={"name": f"dash-{n}", "categoryId": 1, "status": "available"},
        )
        assert answer.status == 201, answer.body
        created.append(answer.body["id"])
    for _ in range(20):
        assert call(url, "GET", "/v1/pets?limit=5", headers=bearer(key)).status == 200
    assert call(url, "GET", f"/v1/pets/{created[0]}", headers=bearer(key)).status == 200
    bad = call(url, "POST", "/v1/pets", headers=bearer(key), json_body={"name": ""})
    assert bad.status == 400
    assert call(url, "GET", "/v1/nope", headers=bearer(key)).status == 404
    burst = [call(url, "GET", "/v1/pets", headers=bearer(burst_key)) for _ in range(8)]
    codes = [a.body["code"] if a.status == 429 else a.status for a in burst]
    assert codes[-1] == "api_key_banned", codes


def lists_while_locked(url: str, key: str, database_url: str) -> list[Answer]:
    """listPets from 8 clients while another session holds the pets table for LOCK_SECONDS."""

    def client(_: int) -> list[Answer]:
        answers = []
        deadline = time.monotonic() + LOCK_SECONDS
        while time.monotonic() < deadline:
            answers.append(call(url, "GET", "/v1/pets", headers=bearer(key), timeout=15))
        return answers

    with psycopg.connect(database_url, autocommit=True) as locker, locker.transaction():
        locker.execute("lock table pets in access exclusive mode")
        with ThreadPoolExecutor(max_workers=8) as executor:
            answers = [a for batch in executor.map(client, range(8)) for a in batch]
    return answers


def with_bool(expr: str) -> str:
    """An alert's expression answering 0 or 1 for each series rather than only the firing ones."""
    changed, found = THRESHOLD.subn(r" \1 bool \2", expr.strip())
    assert found == 1, f"no threshold at the end of {expr}"
    return changed


def test_every_panel_and_alert_answers_from_a_real_prometheus(
    database_url: str, conn: db.Connection, issue_key: Callable[..., str], tmp_path: Path
) -> None:
    key = issue_key("pro")
    burst_key = issue_key("free", per_minute=5)
    dashboard = load_dashboard()
    targets = {
        (panel["title"], target["refId"]): promql(target["expr"])
        for panel in panels(dashboard)
        for target in panel["targets"]
    }
    rules = [
        rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]
    ]
    with RedisServer(tmp_path / "redis") as redis_server:
        serving = {
            "DATABASE_URL": database_url,
            "RATELIMIT_STORAGE_URI": redis_server.url(),
            "PETSTORE_BAN_THRESHOLD": "2",
            "PETSTORE_DB_STATEMENT_TIMEOUT_MS": str(STATEMENT_TIMEOUT_MS),
            "PETSTORE_DB_POOL_SIZE": "1",
            "PETSTORE_USAGE_FLUSH_SECONDS": "0.5",
            "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "metrics-serving"),
        }
        # Declared behind a pooler, so its timeout is the database's, which nobody pinned to this.
        unpinned = {
            "DATABASE_URL": database_url,
            "PETSTORE_DB_POOLER": "transaction",
            "PETSTORE_DB_STATEMENT_TIMEOUT_MS": "4321",
            "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "metrics-unpinned"),
        }
        with (
            DeployedGunicorn(serving, tmp_path / "serving.log", workers=2, threads=2) as server,
            DeployedGunicorn(unpinned, tmp_path / "unpinned.log", workers=1, threads=1) as other,
            Prometheus([server.address, other.address], tmp_path / "prometheus") as prometheus,
        ):
            # Scraped once before the traffic, so that rate() sees the counters start from zero.
            assert prometheus.wait_value('count(up{job="petstore"} == 1)', 2.0) == 2.0
            send_traffic(server.url, key, burst_key)
            locked = lists_while_locked(server.url, key, database_url)
            assert 503 in {a.status for a in locked}, "no statement timed out"
            redis_server.stop()
            after = [call(server.url, "GET", "/v1/pets", headers=bearer(key)) for _ in range(6)]
            assert {a.status for a in after} == {200}, "the limiter counts in memory without Redis"

            def answers() -> dict[tuple[str, str], list[dict[str, Any]]]:
                return {target: prometheus.query(query) for target, query in targets.items()}

            def complete(got: dict[tuple[str, str], list[dict[str, Any]]]) -> bool:
                return all(
                    result and (title in NOT_CAUSED or filled(result))
                    for (title, _ref), result in got.items()
                )

            results = poll_until(answers, complete, 30.0, 0.5)
            workers = {str(pid) for gunicorn in (server, other) for pid in gunicorn.worker_pids()}
            health = poll_until(
                lambda: [
                    (rule["name"], rule["health"], rule.get("lastError", ""))
                    for group in prometheus.get("/api/v1/rules")[1]["data"]["groups"]
                    for rule in group["rules"]
                ],
                lambda got: {state for _name, state, _error in got} == {"ok"},
                20.0,
            )
            alerts = {rule["alert"]: prometheus.query(with_bool(rule["expr"])) for rule in rules}
            pending = poll_until(
                lambda: [
                    (alert["labels"]["alertname"], alert["labels"].get("instance"), alert["state"])
                    for alert in prometheus.get("/api/v1/alerts")[1]["data"]["alerts"]
                ],
                lambda got: ("PetstoreRateLimiterInFallback", server.address, "pending") in got,
                20.0,
            )
            instances = prometheus.get("/api/v1/label/instance/values?match[]=petstore_build_info")[
                1
            ]["data"]

    for (title, ref), result in sorted(results.items()):
        values = sorted({series["value"][1] for series in result})
        print(f"{title} [{ref}]  {targets[title, ref]}\n  => {len(result)} series, {values[:6]}")
    empty = [target for target, result in results.items() if not result]
    assert not empty, f"queries that answer no series: {empty}"
    unfilled = [
        target
        for target, result in results.items()
        if target[0] not in NOT_CAUSED and not filled(result)
    ]
    assert not unfilled, f"queries that answer only zeros: {unfilled}"
    assert sorted(instances) == sorted([server.address, other.address])
    # One series per worker of both instances, by pid.
    for title in ("Worker CPU", "Worker memory", "Worker open file descriptors"):
        assert {series["metric"]["pid"] for series in results[title, "A"]} == workers, title

    # Every alert's rule loaded and evaluated by Prometheus, and each expression answers a
    # series for what the service exports; the fallback's pending on the instance without Redis.
    assert len(health) == len(rules) and {h[1] for h in health} == {"ok"}, health
    for name, result in alerts.items():
        print(f"alert {name}: {[(s['metric'], s['value'][1]) for s in result]}")
    assert all(alerts.values()), alerts
    fallback = {
        s["metric"]["instance"]: s["value"][1] for s in alerts["PetstoreRateLimiterInFallback"]
    }
    assert fallback == {server.address: "1", other.address: "0"}
    assert ("PetstoreRateLimiterInFallback", server.address, "pending") in pending
