"""PostgreSQL with Patroni (deploy/patroni.yml): the service follows the leader, and loses no 201.

etcd and two Patroni-managed PostgreSQL 15 nodes on loopback, synchronous replication; two
gunicorn instances (the shipped config) behind nginx (the shipped site) writing through HAProxy
(deploy/haproxy.cfg: each connection to the node whose Patroni answers GET /primary, the one
holding the leader lock) and reading on the standby by a multi-host URL. Under a mixed load
(creates retried with their Idempotency-Key on 503, lists, gets): kill -9 of the primary's
postmaster alone; of its Patroni and postmaster; of its Patroni alone (its PostgreSQL left
accepting writes), then that Patroni started again; then, with the old primary back as the
synchronous standby, a planned `patronictl switchover`. Each fault answers only 2xx and 503,
writes are back within Patroni's ttl + 5 s, and every 201 is a row on the primary that follows.
Then, with the nodes in network namespaces of their own, the primary cut off the network (both
its links down). The fault table is in the run's summary (`pytest -s` also prints each row).
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime

import pytest
import yaml
from psycopg import conninfo

from tests.support import reports
from tests.support.freshness import FRESH_WITHIN, READ_MAX_LAG, FreshReads
from tests.support.haproxy import HAProxy
from tests.support.hosts import Hosts, cut, ip
from tests.support.load import MixedLoad
from tests.support.nginx import Deployment, deploy
from tests.support.patroni import PATRONI_YML, Cluster, Etcd, PatroniNode
from tests.support.servers import poll_until

DCS = yaml.safe_load(PATRONI_YML.read_text(encoding="utf-8"))["bootstrap"]["dcs"]
TTL = int(DCS["ttl"])
WRITES_BACK_WITHIN = TTL + 5.0
POOL_TIMEOUT = 1.0
CONNECT_TIMEOUT = 2
STATEMENT_TIMEOUT_MS = 2000
ENVIRON = {
    "PETSTORE_PROXY_COUNT": "1",
    "PETSTORE_DB_POOL_TIMEOUT": str(POOL_TIMEOUT),
    "PETSTORE_DB_CONNECT_TIMEOUT": str(CONNECT_TIMEOUT),
    "PETSTORE_DB_RECONNECT_TIMEOUT": "2",
    "PETSTORE_DB_STATEMENT_TIMEOUT_MS": str(STATEMENT_TIMEOUT_MS),
    "PETSTORE_RETRY_AFTER": "1",
    # While there is no primary no key can be looked up: requests spend the address's budget.
    "PETSTORE_IP_LIMITS": "1000000/minute;10000000/day",
}
# The longest the app may take to answer: a pool wait, a connection attempt per host, a statement.
APP_BOUND = POOL_TIMEOUT + 2 * CONNECT_TIMEOUT + STATEMENT_TIMEOUT_MS / 1000
# A statement in flight on a node cut off the network is behind HAProxy, which libpq's TCP
# timeouts do not see and the commit watch's cancel (sent through HAProxy to that node) cannot
# reach: it ends when HAProxy marks the node down and cuts its sessions (deploy/haproxy.cfg: two
# failed checks of up to 1 s connect and 1 s read, the first up to `inter` away, the next
# `fastinter`: 5.5 s, plus the checks' own scheduling: measured 3.0 to 7.1 s), then the app
# answers within its own bound.
HAPROXY_CUTS_WITHIN = 1.0 + 2.0 + 0.5 + 2.0
CLIENTS = 8
WARMUP = 2.0
AFTER_RECOVERY = 2.0
# A backend's counts in pg_stat_database arrive within PostgreSQL's PGSTAT_IDLE_INTERVAL (10 s).
STATS_FLUSH_WITHIN = 15.0


@dataclass
class Outcome:
    """One row of the table: a fault under load and what the clients saw."""

    fault: str
    requests: int
    ok: int
    unavailable: int
    other: int
    longest: float
    writes_back_after: float
    created: int
    rows: int

    HEADER = (
        f"{'fault':<36} {'requests':>8} {'2xx':>6} {'503':>5} {'other':>5} {'longest':>8} "
        f"{'writes back':>11} {'201s':>5} {'rows':>5}"
    )

    def row(self) -> str:
        return (
            f"{self.fault:<36} {self.requests:>8} {self.ok:>6} {self.unavailable:>5} "
            f"{self.other:>5} {self.longest:>6.2f} s {self.writes_back_after:>9.2f} s "
            f"{self.created:>5} {self.rows:>5}"
        )


# Every fault's row, for the run's summary (tests/support/reports.py).
OUTCOMES: list[Outcome] = []


@pytest.fixture(scope="module", autouse=True)
def fault_table() -> Iterator[None]:
    """The outcome table of every fault in the run's summary at the end, as test_faults' is."""
    yield
    if OUTCOMES:
        reports.add(
            "Patroni faults under load (tests/system/test_patroni.py)",
            [Outcome.HEADER, *(outcome.row() for outcome in OUTCOMES)],
        )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(tmp_path_factory.mktemp("patroni"), CONNECT_TIMEOUT) as running:
        yield running


@pytest.fixture(autouse=True)
def whole_cluster(request: pytest.FixtureRequest) -> None:
    """A test on the loopback cluster starts with both nodes up, one leading and the other its
    synchronous standby: a test that failed halfway (a node left down) fails alone."""
    if "cluster" in request.fixturenames:
        request.getfixturevalue("cluster").heal()


@contextmanager
def serve(cluster: Cluster) -> Iterator[Deployment]:
    """Two instances behind nginx, writing through HAProxy (deploy/haproxy.cfg) to the node that
    holds the leader lock; reading on the standby by the multi-host URL."""
    with HAProxy(cluster.workdir / "haproxy", cluster.nodes) as haproxy:
        environ = {
            **ENVIRON,
            "DATABASE_URL": haproxy.url(connect_timeout=CONNECT_TIMEOUT),
            # Lists and gets on the standby while there is one (docs/deploying.rst, "Reads on standbys").
            "PETSTORE_READ_DATABASE_URL": cluster.url(attrs="prefer-standby"),
            "RATELIMIT_STORAGE_URI": cluster.redis.url(),
        }
        with deploy(environ, cluster.workdir / "web", instances=2, workers=2, threads=4) as stack:
            yield stack


@pytest.fixture(scope="module")
def service(cluster: Cluster) -> Iterator[Deployment]:
    with serve(cluster) as stack:
        yield stack


def under_load(
    cluster: Cluster,
    service: Deployment,
    label: str,
    fault: Callable[[], None],
    then: Callable[[], None] | None = None,
) -> tuple[Outcome, MixedLoad]:
    """Run the mixed load, apply `fault`, wait (bounded) for writes to be back, run `then` (still
    under load), then tally."""
    # A create is retried past the longest outage the test allows.
    with MixedLoad(
        service.url, cluster.key, label, clients=CLIENTS, create_deadline=2 * WRITES_BACK_WITHIN
    ).running() as load:
        time.sleep(WARMUP)
        fault_at = time.monotonic()
        fault()

        def writes_back_after() -> float | None:
            """Seconds from the fault to the first 201 after the last failed create, once there is one."""
            with load.lock:
                creates = [a for a in load.answers if a.method == "POST" and a.started >= fault_at]
            failed = [a.started + a.elapsed for a in creates if a.status != 201]
            if not failed and time.monotonic() < fault_at + APP_BOUND:
                # A create in flight at the fault may still fail (the app answers within
                # APP_BOUND): a 201 that slipped in before it does is not writes back.
                return None
            since = max(failed, default=fault_at)
            back = [
                a.started + a.elapsed for a in creates if a.status == 201 and a.started >= since
            ]
            return min(back) - fault_at if back and failed else (0.0 if back else None)

        def settled() -> float | None:
            """writes_back_after() once any request sent before the fault showed would have
            answered (APP_BOUND): a fault that shows late (a silent host) is not missed."""
            return writes_back_after() if time.monotonic() - fault_at >= APP_BOUND else None

        poll_until(settled, lambda value: value is not None, 3 * TTL, 0.2)
        if then is not None:
            then()
        time.sleep(AFTER_RECOVERY)
    # Once every create has its answer (each is retried until a 201): a create that failed after
    # the first 201 (a fault that takes a while to show) moves it on.
    back = writes_back_after()
    statuses = [answer.status for answer in load.answers]
    ok = sum(1 for status in statuses if 200 <= status < 300)
    unavailable = statuses.count(503)
    rows = load.rows(cluster.connect)
    outcome = Outcome(
        fault=label,
        requests=len(statuses),
        ok=ok,
        unavailable=unavailable,
        other=len(statuses) - ok - unavailable,
        longest=max(answer.elapsed for answer in load.answers),
        writes_back_after=float("inf") if back is None else back,
        created=len(load.created),
        rows=sum(rows.values()),
    )
    print(f"\n{Outcome.HEADER}\n{outcome.row()}")
    OUTCOMES.append(outcome)
    return outcome, load


def assert_no_write_lost(
    outcome: Outcome, load: MixedLoad, cluster: Cluster, answered_within: float = APP_BOUND
) -> None:
    """Only 2xx and 503, no request unanswered, writes back in time, one row per 201."""
    assert not load.failures, load.failures[:5]
    assert not load.abandoned, load.abandoned[:5]
    assert outcome.other == 0, sorted({a.status for a in load.answers})
    assert outcome.writes_back_after <= WRITES_BACK_WITHIN, outcome
    assert outcome.longest <= answered_within, outcome
    with cluster.connect() as conn:
        found = conn.execute(
            "select id from pets where id = any(%s)", [sorted(set(load.created))]
        ).fetchall()
    assert len(found) == len(set(load.created)) == outcome.created == outcome.rows, outcome


def test_reads_on_the_standby_and_its_lag(cluster: Cluster, service: Deployment) -> None:
    """No fault: lists and gets are read on the synchronous standby, and its replay lag under the
    mixed load stays small (sampled from the primary's pg_stat_replication)."""
    standby = cluster.standby()
    statement = "select sum(xact_commit)::bigint as n from pg_stat_database"
    with cluster.connect_to(standby) as conn:
        before = conn.execute(statement).fetchone()["n"]
    lags: list[float] = []
    stop = threading.Event()

    def sample() -> None:
        with cluster.connect() as conn:
            while not stop.is_set():
                row = conn.execute(
                    """
                    select coalesce(extract(epoch from max(replay_lag)), 0)::float as lag
                      from pg_stat_replication
                    """
                ).fetchone()
                lags.append(row["lag"])
                time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    load = MixedLoad(service.url, cluster.key, "reads", clients=CLIENTS)
    try:
        load.run(1500)
    finally:
        stop.set()
        sampler.join(timeout=10)
    gets = sum(1 for a in load.answers if a.method == "GET" and a.status == 200)
    with cluster.connect_to(standby) as conn:
        # A backend's counts reach pg_stat_database when it has been idle long enough
        # (PostgreSQL's PGSTAT_IDLE_INTERVAL, 10 s), not at once: a short load ends with many
        # of its reads not yet counted.
        read_there = poll_until(
            lambda: conn.execute(statement).fetchone()["n"] - before,
            lambda counted: counted >= gets // 2,
            within=STATS_FLUSH_WITHIN,
            interval=0.5,
        )
        service_connections = conn.execute(
            """
            select count(*) as n
              from pg_stat_activity
             where application_name = 'petstore'
               and datname = 'petstore'
            """
        ).fetchone()["n"]
    lags.sort()
    print(
        f"\nreads: {len(load.answers)} requests, {gets} gets answered 200, {read_there} "
        f"transactions on the standby ({service_connections} connections of the service); "
        f"replay lag over {len(lags)} samples: median {lags[len(lags) // 2] * 1000:.1f} ms, "
        f"max {lags[-1] * 1000:.1f} ms"
    )
    assert not load.failures, load.failures[:5]
    assert {a.status for a in load.answers} <= {200, 201}
    # The read pools' connections are there, and most gets were read there (a getPet the
    # standby has not yet replayed is read again on the primary).
    assert service_connections > 0
    assert read_there >= gets // 2, (read_there, gets)
    assert lags and lags[-1] < 1.0, lags[-5:]


def test_kill_9_of_the_primary_postmaster_alone(cluster: Cluster, service: Deployment) -> None:
    """The primary's postmaster killed, its Patroni alive: Patroni starts it again (crash recovery)
    on the same node, which keeps the leader lock; 2xx and 503 only, no 201 lost."""
    primary = cluster.primary()

    def kill_postmaster() -> None:
        postmaster = primary.postmaster_pid()
        assert postmaster is not None
        os.kill(postmaster, signal.SIGKILL)

    outcome, load = under_load(
        cluster, service, "kill -9 of the primary's postmaster", kill_postmaster
    )
    assert cluster.primary() is primary
    assert_no_write_lost(outcome, load, cluster)
    assert outcome.unavailable > 0, "the restart was not seen"
    cluster.wait_for_sync_standby(cluster.standby())


def test_kill_9_of_the_primary_loses_no_acknowledged_write(
    cluster: Cluster, service: Deployment
) -> None:
    """Patroni and postmaster of the primary killed (the node is gone): the synchronous standby
    takes over within the ttl, the service follows it without a restart, and every 201 answered
    before is on it."""
    old = cluster.primary()
    standby = cluster.standby()
    outcome, load = under_load(cluster, service, "kill -9 of the primary node", old.kill)
    assert cluster.primary() is standby
    assert_no_write_lost(outcome, load, cluster)
    assert outcome.unavailable > 0, "the failover was not seen"
    # The old primary comes back as the synchronous standby (pg_rewind), for what follows.
    old.start()
    cluster.wait_for_sync_standby(old)


def test_kill_9_of_the_primary_patroni_alone_loses_no_acknowledged_write(
    cluster: Cluster, service: Deployment
) -> None:
    """The primary's Patroni killed, its postmaster left running (an OOM kill of Patroni): the old
    primary still accepts writes, but the standby takes the expired leader lock and writes follow
    the lock, not "accepts writes". Then the old node's Patroni starts again and demotes it, still
    under load: no 201 lost, no request past the bound, writes back within the ttl + 5 s."""
    old = cluster.primary()
    standby = cluster.standby()
    postmaster = old.postmaster_pid()
    assert postmaster is not None

    def kill_patroni() -> None:
        old.kill_patroni()
        os.kill(postmaster, 0)  # the postmaster runs on, and still accepts writes

    def rejoin() -> None:
        assert poll_until(standby.is_primary, bool, 3 * TTL, 0.2), standby.log()
        old.start()
        cluster.wait_for_sync_standby(old)

    outcome, load = under_load(
        cluster, service, "kill -9 of the primary's Patroni alone", kill_patroni, rejoin
    )
    assert cluster.primary() is standby
    assert_no_write_lost(outcome, load, cluster)
    assert outcome.unavailable > 0, "the failover was not seen"


def test_reads_stay_fresh_when_the_primary_patroni_alone_is_killed(
    cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The read URL as docs/deploying.rst shows it, the leader's host first, prefer-standby; the
    leader's Patroni killed (its PostgreSQL alive and writable), started again at ttl + 10 s.
    prefer-standby falls back to the first host when no standby takes a connection: between the
    standby's promotion and the old leader's demotion, that is the deposed primary, whose rows
    stop at the failover. Read connections are made then when they are renewed (every 60 s) or
    lost: the test ends the ones on the promoted node at its promotion, so that they are. Every
    listing made FRESH_WITHIN after a 201 holds the pet (Standbys.not_a_standby)."""
    old = cluster.primary()
    standby = cluster.standby()
    cluster.wait_for_sync_standby(standby)
    leader_first = conninfo.make_conninfo(
        "",
        host=",".join(node.address[0] for node in (old, standby)),
        port=",".join(str(node.address[1]) for node in (old, standby)),
        dbname="petstore",
        user="postgres",
        target_session_attrs="prefer-standby",
        connect_timeout=str(CONNECT_TIMEOUT),
    )
    workdir = tmp_path_factory.mktemp("fresh-reads")
    with HAProxy(workdir / "haproxy", cluster.nodes) as haproxy:
        environ = {
            **ENVIRON,
            "DATABASE_URL": haproxy.url(connect_timeout=CONNECT_TIMEOUT),
            "PETSTORE_READ_DATABASE_URL": leader_first,
            "PETSTORE_READ_MAX_LAG_SECONDS": str(READ_MAX_LAG),
            "RATELIMIT_STORAGE_URI": cluster.redis.url(),
        }
        with deploy(environ, workdir / "web", instances=2, workers=2, threads=4) as service:
            reads = FreshReads(service.url, cluster.key)
            with reads.running():
                time.sleep(WARMUP)
                fault_at = time.monotonic()
                old.kill_patroni()
                assert poll_until(standby.is_primary, bool, 3 * TTL, 0.2), standby.log()
                promoted_at = datetime.now(UTC)
                with cluster.connect_to(standby) as conn:
                    conn.execute(
                        """
                        select pg_terminate_backend(pid)
                          from pg_stat_activity
                         where datname = 'petstore'
                           and backend_type = 'client backend'
                           and backend_start < %s
                           and pid <> pg_backend_pid()
                        """,
                        [promoted_at],
                    )
                window_from = time.monotonic()
                time.sleep(max(0.0, fault_at + TTL + 10 - time.monotonic()))
                old.start()
                cluster.wait_for_sync_standby(old)
                window_to = time.monotonic()
                time.sleep(FRESH_WITHIN + 2.0)
    in_window = reads.between(window_from, window_to)
    print(f"\nfresh reads: {reads.summary()}")
    print(f"{len(in_window)} pets created between the promotion and the old leader's demotion")
    assert not reads.unexpected, reads.unexpected[:5]
    assert cluster.primary() is standby
    # The window between the promotion and the old leader's demotion was probed.
    assert len(in_window) >= 2, (window_to - window_from, len(reads.probes))
    assert all(len(p.listings) >= 10 for p in in_window), [len(p.listings) for p in in_window]
    assert not reads.stale(), reads.stale()[:5]


def test_a_planned_switchover_loses_no_acknowledged_write(
    cluster: Cluster, service: Deployment
) -> None:
    """`patronictl switchover` to the synchronous standby under load: 2xx and 503 only, no 201 lost."""
    old = cluster.primary()
    candidate = cluster.standby()
    cluster.wait_for_sync_standby(candidate)

    def switchover() -> None:
        done = old.patronictl(
            "switchover", "--leader", old.node, "--candidate", candidate.node, "--force"
        )
        assert done.returncode == 0, done.stdout + done.stderr

    outcome, load = under_load(cluster, service, "patronictl switchover", switchover)
    assert cluster.primary() is candidate
    assert_no_write_lost(outcome, load, cluster)


@pytest.fixture(scope="module")
def cluster_on_hosts(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Hosts, Cluster, Deployment]]:
    """db1 and db2 in namespaces of their own, each linked to the machine (etcd, the service) and
    to the other (replication, which reaches the other's machine-side address across it)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 (`ip netns`): run .ci/install-iproute2 as root")
    workdir = tmp_path_factory.mktemp("patroni-hosts")
    hosts = Hosts(["db1", "db2"], [("", "db1"), ("", "db2"), ("db1", "db2")])
    with hosts:
        for node, other in (("db1", "db2"), ("db2", "db1")):
            route = [f"{hosts.address(other, '')}/32", "via", hosts.address(other, node)]
            ip("-n", hosts.netns[node], "route", "add", *route)
        etcd = Etcd(workdir, also_listen=[hosts.address("", name) for name in ("db1", "db2")])

        def place(etcd: Etcd, name: str) -> PatroniNode:
            return PatroniNode(
                workdir,
                name,
                etcd,
                netns=hosts.netns[name],
                host=hosts.address(name, ""),
                etcd_host=hosts.address("", name),
            )

        with Cluster(workdir, CONNECT_TIMEOUT, place, etcd) as running, serve(running) as stack:
            yield hosts, running, stack


def test_the_primary_cut_off_the_network_loses_no_acknowledged_write(
    cluster_on_hosts: tuple[Hosts, Cluster, Deployment],
) -> None:
    """Both links of the primary's host down (no RST: silence): the statements in flight there end
    when HAProxy marks it down and cuts their sessions, the standby takes over when the leader's
    lease expires, and every 201 answered before is on it."""
    hosts, cluster, service = cluster_on_hosts
    old = cluster.primary()
    standby = cluster.standby()

    def cut_off() -> None:
        for peer in ("", standby.node):
            cut(hosts, old.node, peer)

    outcome, load = under_load(cluster, service, "the primary cut off the network", cut_off)
    assert standby.is_primary()
    assert_no_write_lost(outcome, load, cluster, HAPROXY_CUTS_WITHIN + APP_BOUND)
    assert outcome.unavailable > 0, "the cut was not seen"
