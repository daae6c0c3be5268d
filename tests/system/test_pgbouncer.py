"""The service behind Debian's PgBouncer in transaction pooling (deploy/pgbouncer.ini, PETSTORE_DB_POOLER).

No server-side prepared statements, the statement timeout pinned on the database, migrations on
the direct URL, and through the pooler: a mixed concurrent load with every 201 a row, bans,
idempotent retries, 503 while the pooler is down and recovery after its restart.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
import redis
from psycopg import conninfo, sql
from psycopg.rows import dict_row

from petstore import config, db, keys
from tests.conftest import TEST_REDIS_URL
from tests.support.checks import call
from tests.support.databases import empty_database
from tests.support.load import MixedLoad
from tests.support.pgbouncer import PgBouncer
from tests.support.servers import ROOT, Gunicorn, poll_until

STATEMENT_TIMEOUT_MS = 1000
POOL_TIMEOUT = 1.0
CONNECT_TIMEOUT = 1
REQUESTS = 3000
HTTP_TIMEOUT = 15.0
# A pooler that is down is noticed by a pool wait plus a connection attempt; slack for the rest.
UNAVAILABLE_WITHIN = POOL_TIMEOUT + CONNECT_TIMEOUT + 2.0
RECOVERED_WITHIN = 15.0


@dataclass
class Pooled:
    """PgBouncer in front of a scratch database migrated through the CLI, and the service's environment."""

    pgbouncer: PgBouncer
    direct_url: str
    environ: dict[str, str]
    workdir: Path

    def direct(self) -> db.Connection:
        """A connection to PostgreSQL itself, not the pooler."""
        return db.connect(config.from_environ({"DATABASE_URL": self.direct_url}))

    def gunicorn(self, name: str, **environ: str) -> Gunicorn:
        """A gunicorn (2 workers × 4 threads) of the service through the pooler."""
        return Gunicorn({**self.environ, **environ}, self.workdir / f"{name}.log")


def upgrade(environ: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`petstore db upgrade` with `environ` (and nothing of the test runner's database settings)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PETSTORE_", "DATABASE_"))}
    return subprocess.run(
        [str(Path(sys.executable).with_name("petstore")), "db", "upgrade"],
        cwd=ROOT,
        env={**clean, **environ},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture(scope="module")
def pooled(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pooled]:
    """A scratch database behind a PgBouncer of the test's own, migrated as docs/deploying.rst says."""
    redis_url = os.environ.get("PETSTORE_TEST_REDIS_URL", TEST_REDIS_URL)
    # Key ids start at 1 in the scratch database: counters of other tests' keys must not count.
    redis.Redis.from_url(redis_url, socket_timeout=2).flushdb()
    workdir = tmp_path_factory.mktemp("pgbouncer")
    with empty_database(database_url, "_pgbouncer") as direct_url:
        with PgBouncer(workdir, direct_url) as pgbouncer:
            environ = {
                "DATABASE_URL": pgbouncer.url(),
                "PETSTORE_DB_POOLER": "transaction",
                "PETSTORE_MIGRATION_DATABASE_URL": direct_url,
                "PETSTORE_DB_STATEMENT_TIMEOUT_MS": str(STATEMENT_TIMEOUT_MS),
                "PETSTORE_DB_POOL_TIMEOUT": str(POOL_TIMEOUT),
                "PETSTORE_DB_CONNECT_TIMEOUT": str(CONNECT_TIMEOUT),
                "PETSTORE_DB_RECONNECT_TIMEOUT": "2",
                "RATELIMIT_STORAGE_URI": redis_url,
                "PETSTORE_BAN_THRESHOLD": "3",
            }
            done = upgrade(environ)
            assert done.returncode == 0, done.stderr
            assert "applied:" in done.stdout
            yield Pooled(pgbouncer, direct_url, environ, workdir)


def bearer(key: str, **headers: str) -> dict[str, str]:
    """The request headers of `key`."""
    return {"Authorization": f"Bearer {key}", **headers}


def issue(pooled: Pooled, plan: str = "enterprise", per_minute: int = 10_000_000) -> str:
    """A new key, made on the direct connection."""
    with pooled.direct() as conn:
        key, _row = keys.issue_key(conn, plan, "pgbouncer", per_minute, 100_000_000)
    return key


def test_upgrade_behind_the_pooler_needs_the_direct_url(pooled: Pooled) -> None:
    """The migrations' session lock cannot work through transaction pooling: the CLI says what to set."""
    environ = {k: v for k, v in pooled.environ.items() if k != "PETSTORE_MIGRATION_DATABASE_URL"}
    done = upgrade(environ)
    assert done.returncode != 0
    assert "PETSTORE_MIGRATION_DATABASE_URL" in done.stderr


def test_a_slow_statement_is_cut_behind_the_pooler(pooled: Pooled) -> None:
    """pg_sleep through the pooler is cancelled at the pinned timeout, and nothing is prepared server-side."""
    settings = {
        **config.from_environ(pooled.environ),
        "DATABASE_URL": pooled.pgbouncer.url(),
    }
    with db.connect(settings) as conn:
        assert conn.prepare_threshold is None
        for _ in range(10):  # past psycopg's default threshold of 5
            conn.execute("select 1 where %s", [True])
        assert conn.execute("select count(*) as n from pg_prepared_statements").fetchone() == {
            "n": 0
        }
        started = time.monotonic()
        with pytest.raises(psycopg.errors.QueryCanceled):
            conn.execute("select pg_sleep(5)")
        assert time.monotonic() - started < 4.0


def test_a_slow_request_gets_503_not_500(pooled: Pooled) -> None:
    """A request whose statement waits past the timeout (a table lock held elsewhere) answers 503, then 200."""
    key = issue(pooled)
    with pooled.gunicorn("slow") as app, pooled.direct() as locker:
        url = f"{app.url}"
        with locker.transaction():
            locker.execute("lock table pets in access exclusive mode")
            answer = call(url, "GET", "/v1/pets", headers=bearer(key), timeout=HTTP_TIMEOUT)
        assert answer.status == 503, (answer.status, answer.body)
        assert answer.is_json_error and answer.body["code"] == "service_unavailable"
        assert answer.elapsed >= STATEMENT_TIMEOUT_MS / 1000 * 0.9
        # Cut by the pinned timeout, not by a pool wait or a lost connection.
        assert (
            "QueryCanceled: canceling statement due to statement timeout"
            in app.log_path.read_text(encoding="utf-8")
        )
        assert call(url, "GET", "/v1/pets", headers=bearer(key)).status == 200


def pinned_timeouts(conn: db.Connection) -> list[str]:
    """The statement_timeout settings pinned on the connection's database (ALTER DATABASE ... SET)."""
    rows = conn.execute(
        """
        select unnest(s.setconfig) as setting
          from pg_db_role_setting s
          join pg_database d on d.oid = s.setdatabase
         where d.datname = current_database()
           and s.setrole = 0
        """
    ).fetchall()
    return [row["setting"] for row in rows if row["setting"].startswith("statement_timeout=")]


def restart_pooler(pooled: Pooled) -> None:
    """A new PgBouncer process: its server connections start with the database's settings of now."""
    pooled.pgbouncer.stop()
    pooled.pgbouncer.start()


def test_a_database_never_pinned_still_serves(pooled: Pooled) -> None:
    """Issue 27 §2, as a new user meets it: PgBouncer with the common recipe in front of a database
    whose statement timeout was never pinned, nothing else set. It serves (200, not 503) while
    /healthz, the metric and one log line per connection say so; a plain `petstore db upgrade`,
    without PETSTORE_DB_POOLER, pins it."""
    key = issue(pooled)
    with pooled.direct() as conn:
        dbname = conn.execute("select current_database() as name").fetchone()
        assert dbname is not None
        conn.execute(
            sql.SQL("alter database {} reset statement_timeout").format(
                sql.Identifier(dbname["name"])
            )
        )
    recipe = {"ignore_startup_parameters": "options,extra_float_digits"}
    environ = {"PETSTORE_DB_POOLER": "", "PETSTORE_MIGRATION_DATABASE_URL": ""}
    try:
        with PgBouncer(pooled.workdir / "recipe", pooled.direct_url, settings=recipe) as bouncer:
            environ["DATABASE_URL"] = bouncer.url()
            with pooled.gunicorn("never-pinned", **environ) as app:
                answer = call(app.url, "GET", "/v1/pets", headers=bearer(key), timeout=HTTP_TIMEOUT)
                health = call(app.url, "GET", "/healthz")
                scraped = call(app.url, "GET", "/metrics").body
                log_text = app.log_path.read_text(encoding="utf-8")
            assert answer.status == 200, (answer.status, answer.body)
            assert health.status == 200, health
            assert health.body["status"] == "ok"
            assert health.body["warnings"] == [
                f"statement_timeout is 0 ms on the server, expected {STATEMENT_TIMEOUT_MS} ms "
                "(PETSTORE_DB_STATEMENT_TIMEOUT_MS): statements run unbounded until `petstore db "
                "upgrade` pins it on the database"
            ]
            assert "petstore_db_statement_timeout_unpinned 1.0" in scraped, scraped
            warned = log_text.count("statement_timeout behind the pooler is 0 ms")
            # Once per new connection: 2 workers, each a pool of PETSTORE_DB_POOL_SIZE (4).
            assert 1 <= warned <= 2 * 4, log_text

            # As a new user would: migrated with the direct URL only, no pooler setting.
            done = upgrade(
                {
                    "DATABASE_URL": pooled.direct_url,
                    "PETSTORE_DB_STATEMENT_TIMEOUT_MS": str(STATEMENT_TIMEOUT_MS),
                }
            )
            assert done.returncode == 0, done.stderr
            with pooled.direct() as conn:
                assert pinned_timeouts(conn) == [f"statement_timeout={STATEMENT_TIMEOUT_MS}"]
            bouncer.stop()  # its server connections started before the pin
            bouncer.start()
            with pooled.gunicorn("pinned-again", **environ) as app:
                health = call(app.url, "GET", "/healthz").body
                assert health["status"] == "ok" and "warnings" not in health, health
                scraped = call(app.url, "GET", "/metrics").body
                assert "petstore_db_statement_timeout_unpinned 0.0" in scraped, scraped
    finally:
        done = upgrade(pooled.environ)
        assert done.returncode == 0, done.stderr
        restart_pooler(pooled)


def test_mixed_concurrent_load_through_the_pooler(pooled: Pooled) -> None:
    """16 clients, 3,000 mixed requests: no 5xx, and exactly one row per 201."""
    key = issue(pooled)
    with pooled.gunicorn("load") as app:
        load = MixedLoad(app.url, key, "load")
        load.run(REQUESTS)
    statuses = Counter(answer.status for answer in load.answers)
    rows = load.rows(pooled.direct)
    print(
        f"\nPgBouncer load: {len(load.answers)} requests, statuses {dict(statuses)}, "
        f"201s {statuses[201]}, rows {sum(rows.values())}, no answer {len(load.failures)}"
    )
    assert not load.failures, load.failures[:5]
    assert len(load.answers) == REQUESTS
    assert not [status for status in statuses if status >= 500], statuses
    assert set(statuses) <= {200, 201}, statuses
    assert sum(rows.values()) == statuses[201] == len(load.created)
    assert max(rows.values()) == 1


def test_bans_and_idempotency_through_the_pooler(pooled: Pooled) -> None:
    """A key that keeps calling after 429 is banned; a repeated create answers the first pet."""
    key = issue(pooled, per_minute=3)
    with pooled.gunicorn("bans") as app:
        headers = bearer(key, **{"Idempotency-Key": uuid.uuid4().hex})
        body = {"name": "once", "categoryId": 1, "status": "available"}
        first = call(app.url, "POST", "/v1/pets", headers=headers, json_body=body)
        again = call(app.url, "POST", "/v1/pets", headers=headers, json_body=body)
        assert (first.status, again.status) == (201, 201)
        assert again.body == first.body
        # 3 per minute: the third GET is the last allowed; strikes 1..3, then banned.
        answers = [call(app.url, "GET", "/v1/pets", headers=bearer(key)) for _ in range(6)]
        statuses = [answer.status for answer in answers]
        assert statuses == [200, 429, 429, 429, 429, 429], statuses
        assert answers[-1].is_json_error and answers[-1].body["code"] == "api_key_banned"
    with pooled.direct() as conn:
        assert conn.execute("select count(*) as n from pets where name = 'once'").fetchone() == {
            "n": 1
        }
        assert conn.execute("select count(*) as n from bans").fetchone()["n"] >= 1


def test_pgbouncer_restart_under_load(pooled: Pooled) -> None:
    """PgBouncer down: prompt 503s (no 500, no hang); back up: 200 again without restarting the service."""
    key = issue(pooled)
    with pooled.gunicorn("restart") as app:
        with MixedLoad(app.url, key, "restart").running() as load:
            time.sleep(1.0)
            pooled.pgbouncer.stop()
            down_at = time.monotonic()
            time.sleep(1.5)
            pooled.pgbouncer.start()
            recovered = poll_until(
                lambda: call(app.url, "GET", "/v1/pets", headers=bearer(key)).status,
                lambda status: status == 200,
                within=RECOVERED_WITHIN,
                interval=0.2,
            )
            recovered_after = time.monotonic() - down_at
            time.sleep(1.0)
    statuses = Counter(answer.status for answer in load.answers)
    rows = load.rows(pooled.direct)
    slowest = max(answer.elapsed for answer in load.answers)
    print(
        f"\nPgBouncer restart: {len(load.answers)} requests, statuses {dict(statuses)}, "
        f"slowest {slowest:.2f} s, recovered after {recovered_after:.2f} s, rows {sum(rows.values())}"
    )
    assert recovered == 200
    assert not load.failures, load.failures[:5]
    assert set(statuses) <= {200, 201, 503}, statuses
    assert statuses[503] > 0, "the outage was not seen"
    unavailable = [a for a in load.answers if a.status == 503]
    assert all(a.is_json_error for a in unavailable)
    assert max(a.elapsed for a in unavailable) < UNAVAILABLE_WITHIN
    assert sum(rows.values()) == statuses[201] == len(load.created)
    assert max(rows.values()) == 1


def test_an_undeclared_pooler_never_gives_a_wrong_answer(pooled: Pooled) -> None:
    """The pooler left out of the settings (no PETSTORE_DB_POOLER), and a PgBouncer that drops the
    `options` it cannot forward (ignore_startup_parameters): the service finds the pooler itself and
    prepares nothing, so no statement is bound to another client's plan: 200 and 201 only, every
    get finds its pet, one row per 201."""
    workdir = pooled.workdir / "undeclared"
    settings = {"ignore_startup_parameters": "options"}
    with PgBouncer(workdir, pooled.direct_url, settings=settings) as lenient:
        key = issue(pooled)
        environ = {
            "DATABASE_URL": lenient.url(),
            "PETSTORE_DB_POOLER": "",
            # The database's own (pinned by the fixture's upgrade): the pool checks it.
            "PETSTORE_DB_STATEMENT_TIMEOUT_MS": str(STATEMENT_TIMEOUT_MS),
        }
        with pooled.gunicorn("undeclared", **environ) as app:
            load = MixedLoad(app.url, key, "undeclared")
            load.run(1500)
        log_text = app.log_path.read_text(encoding="utf-8")
    statuses = Counter(answer.status for answer in load.answers)
    rows = load.rows(pooled.direct)
    print(
        f"\nUndeclared PgBouncer: {len(load.answers)} requests, statuses {dict(statuses)}, "
        f"201s {statuses[201]}, rows {sum(rows.values())}"
    )
    assert "DATABASE_URL leads through a pooler" in log_text
    assert not load.failures, load.failures[:5]
    assert set(statuses) == {200, 201}, statuses
    assert sum(rows.values()) == statuses[201] == len(load.created)
    assert max(rows.values()) == 1


def test_an_undeclared_pooler_with_another_timeout_still_serves(pooled: Pooled) -> None:
    """Undeclared, and the service's statement timeout is not the database's: served (no wrong
    answer comes of it), with /healthz naming both timeouts and the log saying it."""
    workdir = pooled.workdir / "undeclared-unpinned"
    settings = {"ignore_startup_parameters": "options"}
    with PgBouncer(workdir, pooled.direct_url, settings=settings) as lenient:
        key = issue(pooled)
        environ = {
            "DATABASE_URL": lenient.url(),
            "PETSTORE_DB_POOLER": "",
            "PETSTORE_DB_STATEMENT_TIMEOUT_MS": "60000",
        }
        with pooled.gunicorn("undeclared-unpinned", **environ) as app:
            answer = call(app.url, "GET", "/v1/pets", headers=bearer(key), timeout=HTTP_TIMEOUT)
            health = call(app.url, "GET", "/healthz")
            assert answer.status == 200, (answer.status, answer.body)
            assert health.status == 200
            assert health.body["warnings"][0].startswith(
                f"statement_timeout is {STATEMENT_TIMEOUT_MS} ms on the server, expected 60000 ms"
            )
            assert "statement_timeout behind the pooler is" in app.log_path.read_text()


def read_only(url: str, on: bool) -> None:
    """Make every new session of `url`'s database read-only (a standby, as libpq sees it) or
    not, and cut its sessions: a PgBouncer before it logs in again, and learns the new value."""
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute("set default_transaction_read_only = off")
        admin.execute(
            sql.SQL("alter database {} set default_transaction_read_only = {}").format(
                sql.Identifier(admin.info.dbname), sql.Literal("on" if on else "off")
            )
        )
        admin.execute(
            "select pg_terminate_backend(pid) from pg_stat_activity "
            "where datname = %s and pid <> pg_backend_pid()",
            [admin.info.dbname],
        )


def test_a_failover_behind_the_pgbouncers_is_followed(database_url: str, tmp_path: Path) -> None:
    """Two PgBouncers, each before a database of its own (a node): the first one's read-write
    (the primary), the second one's read-only (a standby), then the roles swap. Each bouncer
    tells its new clients the role it cached at its first login (PgBouncer issue #859), so
    libpq's target_session_attrs=read-write takes the demoted node and refuses the promoted one;
    the service's pool asks the servers and takes the promoted one."""
    with (
        empty_database(database_url, "_demoted") as demoted_url,
        empty_database(database_url, "_promoted") as promoted_url,
        PgBouncer(tmp_path / "demoted", demoted_url) as demoted,
        PgBouncer(tmp_path / "promoted", promoted_url) as promoted,
    ):
        both = conninfo.make_conninfo(
            demoted.url(),
            host="127.0.0.1,127.0.0.1",
            port=f"{demoted.port},{promoted.port}",
            target_session_attrs="read-write",
            connect_timeout=str(CONNECT_TIMEOUT),
        )
        settings = config.from_environ({"DATABASE_URL": both, "PETSTORE_DB_POOLER": "transaction"})
        for url in (demoted_url, promoted_url):
            with psycopg.connect(url, autocommit=True, row_factory=dict_row) as admin:
                db.pin_statement_timeout(admin, settings["DB_STATEMENT_TIMEOUT_MS"])
        read_only(promoted_url, True)
        # Each bouncer's first login, with the roles before the failover.
        for bouncer, role in ((demoted, "off"), (promoted, "on")):
            with psycopg.connect(bouncer.url()) as first:
                assert first.info.parameter_status("default_transaction_read_only") == role
        read_only(demoted_url, True)
        read_only(promoted_url, False)
        with psycopg.connect(both) as stale:
            # The failure itself: libpq takes the demoted node, where a write is refused.
            name = conninfo.conninfo_to_dict(demoted_url)["dbname"]
            assert stale.execute("select current_database()").fetchone() == (name,)
            with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
                stale.execute("create table t (n int)")
        pool = db.open_pool({**settings, "DB_POOL_SIZE": 1})
        try:
            with pool.connection(timeout=10) as conn:
                row = conn.execute("select current_database() as name").fetchone()
                assert row == {"name": conninfo.conninfo_to_dict(promoted_url)["dbname"]}
                conn.execute("create table t (n int)")
        finally:
            pool.close()


SLOW_COMMIT = """
create function wait_at_commit() returns trigger language plpgsql as $$
begin
    if new.name = 'at-commit' then
        perform pg_advisory_xact_lock(%(lock)s);
    end if;
    return null;
end $$;
create constraint trigger wait_at_commit after insert on pets
    deferrable initially deferred for each row execute function wait_at_commit();
"""
LOCK = 727


def test_a_server_gone_during_a_commit_is_503_and_the_retry_stores_once(pooled: Pooled) -> None:
    """The backend running a create's COMMIT is terminated (as when its postmaster dies): behind
    PgBouncer the COMMIT gets the backend's FATAL and the bouncer's "server conn crashed?", two
    answers psycopg cannot account for (InternalError). Whether it committed is unknown to the
    service: 503 with Retry-After, and the retry with the same Idempotency-Key stores one pet."""
    key = issue(pooled)
    headers = bearer(key, **{"Idempotency-Key": uuid.uuid4().hex})
    body = {"name": "at-commit", "categoryId": 1, "status": "available"}
    with pooled.direct() as admin:
        admin.execute(SLOW_COMMIT % {"lock": LOCK})
    try:
        with pooled.gunicorn("at-commit") as app, pooled.direct() as holder:
            holder.execute("select pg_advisory_lock(%s)", [LOCK])
            answers = []
            sender = threading.Thread(
                target=lambda: answers.append(
                    call(app.url, "POST", "/v1/pets", headers=headers, json_body=body)
                )
            )
            sender.start()
            # The COMMIT waits in the deferred trigger for the lock (the statement timeout, 1 s,
            # is the bound on finding it); then its backend is terminated.
            waiting = poll_until(
                lambda: holder.execute(
                    """
                    select pid
                      from pg_stat_activity
                     where query = 'COMMIT' and wait_event_type = 'Lock'
                    """
                ).fetchone(),
                lambda row: row is not None,
                STATEMENT_TIMEOUT_MS / 1000,
                0.01,
            )
            assert waiting is not None, "no COMMIT waited at the lock"
            holder.execute("select pg_terminate_backend(%s)", [waiting["pid"]])
            sender.join(timeout=HTTP_TIMEOUT)
            holder.execute("select pg_advisory_unlock(%s)", [LOCK])
            (refused,) = answers
            log = app.log_path.read_text(encoding="utf-8")
            assert refused.status == 503, (refused.status, refused.body, log[-3000:])
            assert refused.body["code"] == "service_unavailable"
            assert int(refused.headers["Retry-After"]) >= 1
            assert "received 2 results from command 'COMMIT'" in log
            again = call(app.url, "POST", "/v1/pets", headers=headers, json_body=body)
            assert again.status == 201, (again.status, again.body)
        with pooled.direct() as conn:
            rows = conn.execute("select id from pets where name = 'at-commit'").fetchall()
        assert rows == [{"id": again.body["id"]}]
    finally:
        with pooled.direct() as admin:
            admin.execute("drop trigger wait_at_commit on pets")
            admin.execute("drop function wait_at_commit()")
