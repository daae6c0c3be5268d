"""Several hosts: nginx and two app instances in network namespaces, PgBouncer and Redis on the machine.

Through nginx: the client's real address reaches the app, a forged X-Forwarded-For buys nothing,
one key's budget holds across both hosts, a ban made on one host holds on the other, and
stopping one host's gunicorn under load loses no write.
"""

from __future__ import annotations

import os
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from petstore import config, db, keys, migrations
from tests.support.checks import call
from tests.support.databases import empty_database
from tests.support.hosts import HostGunicorn, Hosts, SharedRedis
from tests.support.load import MixedLoad
from tests.support.nginx import Nginx
from tests.support.pgbouncer import PgBouncer
from tests.support.programs import program
from tests.support.servers import poll_until

APPS = ("app1", "app2")
LINKS = [("", "nginx"), ("", "app1"), ("", "app2"), ("nginx", "app1"), ("nginx", "app2")]
IP_PER_MINUTE = 5
BAN_THRESHOLD = 3


@dataclass
class Site:
    """The running hosts and servers."""

    hosts: Hosts
    apps: dict[str, HostGunicorn]
    nginx: Nginx
    direct_url: str

    @property
    def client_address(self) -> str:
        """The test's own address, as nginx sees it."""
        return self.hosts.address("", "nginx")

    def issue(self, plan: str, per_minute: int | None = None) -> tuple[str, int]:
        with self.connect() as conn:
            key, row = keys.issue_key(
                conn, plan, "hosts", per_minute, 100_000_000 if per_minute else None
            )
        return key, int(row["id"])

    def connect(self) -> db.Connection:
        return db.connect(config.from_environ({"DATABASE_URL": self.direct_url}))


@pytest.fixture(scope="module")
def site(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    """Namespaces nginx, app1 and app2; PgBouncer and Redis on the machine's end of each app's link."""
    if os.geteuid() != 0:
        pytest.skip("needs root (`ip netns`): run it as root, after `bash .ci/install-iproute2`")
    program("ip")
    workdir = tmp_path_factory.mktemp("hosts")
    hosts = Hosts(["nginx", *APPS], LINKS)
    with empty_database(database_url, "_hosts") as direct_url, hosts:
        with db.connect(config.from_environ({"DATABASE_URL": direct_url})) as conn:
            migrations.upgrade(conn)
            db.pin_statement_timeout(conn, 5000)
        machine = [hosts.address("", app) for app in APPS]
        with (
            PgBouncer(workdir / "pgbouncer", direct_url, also_listen=machine) as pgbouncer,
            SharedRedis(workdir / "redis", also_bind=machine) as redis,
        ):
            apps: dict[str, HostGunicorn] = {}
            proxy: Nginx | None = None
            try:
                for app in APPS:
                    here = hosts.address("", app)
                    environ = {
                        "DATABASE_URL": pgbouncer.url(host=here),
                        "PETSTORE_DB_POOLER": "transaction",
                        "RATELIMIT_STORAGE_URI": redis.url_at(here),
                        "PETSTORE_PROXY_COUNT": "1",
                        "PETSTORE_IP_LIMITS": f"{IP_PER_MINUTE}/minute;1000/day",
                        "PETSTORE_BAN_THRESHOLD": str(BAN_THRESHOLD),
                    }
                    apps[app] = HostGunicorn(
                        environ,
                        workdir / f"{app}.log",
                        hosts.netns[app],
                        [hosts.address(app, "nginx"), hosts.address(app, "")],
                    )
                    apps[app].start()
                proxy = Nginx(
                    [apps[app].address for app in APPS],
                    workdir / "nginx",
                    host=hosts.address("nginx", ""),
                    netns=hosts.netns["nginx"],
                )
                proxy.start()
                yield Site(hosts, apps, proxy, direct_url)
            finally:
                if proxy is not None:
                    proxy.stop()
                for running in apps.values():
                    running.stop()


def test_the_real_address_reaches_the_app_and_a_forged_one_buys_nothing(site: Site) -> None:
    """Each app logs the client's address whatever X-Forwarded-For says; the per-IP budget is one."""
    request_id = f"hosts-{uuid.uuid4().hex}"
    forged = {"X-Forwarded-For": "203.0.113.9", "X-Request-ID": request_id}
    answer = call(site.nginx.url, "GET", "/v1/pets", headers=forged)
    assert answer.status == 401
    logged = poll_until(
        lambda: [
            record
            for app in site.apps.values()
            for record in app.records()
            if record.get("request_id") == request_id
        ],
        bool,
        within=5.0,
    )
    assert [record["client_ip"] for record in logged] == [site.client_address]

    statuses = [
        call(
            site.nginx.url,
            "GET",
            "/v1/pets",
            headers={"X-Forwarded-For": f"198.51.100.{n}"},
        ).status
        for n in range(IP_PER_MINUTE + 3)
    ]
    # The first request above spent one of the address's budget already.
    assert statuses == [401] * (IP_PER_MINUTE - 1) + [429] * 4, statuses


def test_one_budget_across_both_hosts(site: Site) -> None:
    """80 concurrent requests of a free key through nginx: exactly 60 × 200, served by both hosts."""
    key, _key_id = site.issue("free")
    headers = {"Authorization": f"Bearer {key}", "Connection": "close"}
    with ThreadPoolExecutor(max_workers=8) as executor:
        futures = [
            executor.submit(call, site.nginx.url, "GET", "/v1/pets", headers=headers)
            for _ in range(80)
        ]
        answers = [future.result() for future in futures]
    statuses = Counter(answer.status for answer in answers)
    assert statuses == {200: 60, 429: 20}, statuses
    upstreams = {
        entry["upstream"].split(", ")[-1]
        for entry in site.nginx.logged(
            [answer.header("x-request-id") or "" for answer in answers]
        ).values()
    }
    assert upstreams == {site.apps[app].address for app in APPS}, upstreams


def test_a_ban_made_on_one_host_holds_on_the_other(site: Site) -> None:
    """A key banned through app1 (its strikes counted there) gets api_key_banned from app2."""
    key, key_id = site.issue("enterprise", per_minute=2)
    headers = {"Authorization": f"Bearer {key}"}
    first = [call(site.apps["app1"].url, "GET", "/v1/pets", headers=headers) for _ in range(5)]
    assert [answer.status for answer in first] == [200, 200, 429, 429, 429]
    other = call(site.apps["app2"].url, "GET", "/v1/pets", headers=headers)
    assert other.status == 429 and other.body["code"] == "api_key_banned", other.body
    with site.connect() as conn:
        row = conn.execute("select count(*) as n from bans where key_id = %s", [key_id])
        assert row.fetchone() == {"n": 1}


def test_stopping_one_host_under_load_loses_no_write(site: Site) -> None:
    """app1's gunicorn stopped (SIGTERM) under load through nginx: every create ends in one row."""
    key, _key_id = site.issue("enterprise", per_minute=10_000_000)
    with MixedLoad(site.nginx.url, key, "hosts-stop", clients=8).running() as load:
        time.sleep(1.5)
        stopped_at = time.monotonic()
        site.apps["app1"].stop()
        time.sleep(3.0)
    statuses = Counter(answer.status for answer in load.answers)
    after = [a for a in load.answers if a.started >= stopped_at]
    rows = load.rows(site.connect)
    print(
        f"\nOne host stopped under load: {len(load.answers)} requests, statuses {dict(statuses)}, "
        f"{len(after)} after the stop, creates {len(load.created)}, rows {sum(rows.values())}, "
        f"no answer {len(load.failures)}"
    )
    assert len(after) >= 20, "too little load after the stop to prove anything"
    assert set(statuses) <= {200, 201, 503}, statuses
    assert not load.abandoned, load.abandoned[:5]
    assert sum(rows.values()) == len(load.created)
    assert max(rows.values()) == 1
    assert {a.status for a in after[-10:]} <= {200, 201}
