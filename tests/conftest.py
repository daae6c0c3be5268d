"""Fixtures: a real PostgreSQL database migrated once per session, clean tables per test, apps, keys, the CLI."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
from click.testing import CliRunner, Result
from flask import Flask
from flask.testing import FlaskClient
from psycopg import conninfo, sql

from petstore import config, create_app, db, keys, migrations
from petstore.cli import main
from tests.support import reports

ROOT = Path(__file__).resolve().parent.parent
TEST_DBNAME = "petstore_test"
TEST_REDIS_URL = "redis://127.0.0.1:6379/15"

Cli = Callable[..., Result]


def server_and_dbname() -> tuple[str, str, Path | None]:
    """(URL of a database to administer the server from, name of the test database, embedded datadir)."""
    explicit = os.environ.get("PETSTORE_TEST_DATABASE_URL")
    if explicit:
        dbname = conninfo.conninfo_to_dict(explicit).get("dbname")
        if not dbname:
            raise pytest.UsageError("PETSTORE_TEST_DATABASE_URL must name a database")
        return conninfo.make_conninfo(explicit, dbname="postgres"), str(dbname), None
    shared = os.environ.get("DATABASE_URL")
    if shared:
        # Never the application's own database: tests truncate tables.
        return conninfo.make_conninfo(shared, dbname="postgres"), TEST_DBNAME, None
    from petstore.dev import embedded

    datadir = ROOT / "var" / "test-postgres"
    return embedded.ensure_running(datadir), TEST_DBNAME, datadir


@pytest.fixture(scope="session")
def database_url() -> Iterator[str]:
    """A freshly created, migrated test database; its libpq URL."""
    admin_url, dbname, datadir = server_and_dbname()
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(
            sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(dbname))
        )
        admin.execute(sql.SQL("create database {}").format(sql.Identifier(dbname)))
    url = conninfo.make_conninfo(admin_url, dbname=dbname)
    settings = config.from_environ({"DATABASE_URL": url})
    with db.connect(settings) as conn:
        migrations.upgrade(conn)
    yield url
    if datadir is not None:
        from petstore.dev import embedded

        # The next run reuses the embedded cluster, not this database (it is made anew): drop it.
        with psycopg.connect(admin_url, autocommit=True) as admin:
            admin.execute(
                sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(dbname))
            )
            admin.execute("checkpoint")
        embedded.stop(datadir)


@pytest.fixture(scope="session")
def truncate_tables(database_url: str) -> sql.Composed:
    """The statement that empties every table the migrations made: a new table needs no line here."""
    with db.connect(config.from_environ({"DATABASE_URL": database_url})) as conn:
        rows = conn.execute(
            "select tablename from pg_tables"
            " where schemaname = current_schema() and tablename <> 'schema_migrations'"
            " order by tablename"
        ).fetchall()
    tables = sql.SQL(", ").join(sql.Identifier(row["tablename"]) for row in rows)
    return sql.SQL("truncate {} restart identity cascade").format(tables)


@pytest.fixture
def conn(database_url: str, truncate_tables: sql.Composed) -> Iterator[db.Connection]:
    """A direct connection to the test database, with every table emptied first."""
    with db.connect(config.from_environ({"DATABASE_URL": database_url})) as conn:
        conn.execute(truncate_tables)
        yield conn


@pytest.fixture
def make_app(conn: db.Connection, database_url: str) -> Iterator[Callable[..., Flask]]:
    """Build apps with settings overridden; their pools are closed after the test."""
    apps: list[Flask] = []

    def build(**settings: Any) -> Flask:
        app = create_app({"DATABASE_URL": database_url, "TESTING": True, **settings})
        apps.append(app)
        return app

    yield build
    for app in apps:
        for pool in ("petstore.pool", "petstore.read_pool"):
            if pool in app.extensions:
                app.extensions[pool].close()


@pytest.fixture
def app(make_app: Callable[..., Flask]) -> Flask:
    return make_app()


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    return app.test_client()


@pytest.fixture
def issue_key(conn: db.Connection) -> Callable[..., str]:
    """Create a key through the same code as `petstore keys create`; return the secret."""

    def issue(plan: str = "free", **numbers: Any) -> str:
        key, _row = keys.issue_key(
            conn, plan, "test", numbers.get("per_minute"), numbers.get("per_day")
        )
        return key

    return issue


@pytest.fixture
def cli(database_url: str, conn: db.Connection, tmp_path: Path) -> Cli:
    """Run `petstore ARGS...` in-process against the (emptied) test database.

    Its var/ is an empty directory of the test's: what a `make run` of this checkout recorded
    must not count.
    """

    def run(*args: str, env: dict[str, str | None] | None = None) -> Result:
        environ = {"DATABASE_URL": database_url, "PETSTORE_VAR_DIR": str(tmp_path), **(env or {})}
        return CliRunner().invoke(main, list(args), env=environ)

    return run


@pytest.fixture
def api_key(issue_key: Callable[..., str]) -> str:
    return issue_key("free")


@pytest.fixture
def auth_headers(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"}


@pytest.fixture
def redis_url() -> str:
    """The test Redis (PETSTORE_TEST_REDIS_URL), its database emptied; unreachable: fail on CI, else skip."""
    url = os.environ.get("PETSTORE_TEST_REDIS_URL", TEST_REDIS_URL)
    client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    try:
        client.ping()
        # Key ids restart at 1 in every test: counters of an earlier test would collide.
        client.flushdb()
    except redis.RedisError as exc:
        message = f"no Redis at {url} ({exc}); set PETSTORE_TEST_REDIS_URL"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    finally:
        client.close()
    return url


def count_pets(conn: db.Connection) -> int:
    row = conn.execute("select count(*) as n from pets").fetchone()
    assert row is not None
    n: int = row["n"]
    return n


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The reports tests added (support.reports), after the progress dots and before the counts."""
    for title, lines in reports.REPORTS:
        terminalreporter.write_sep("=", title)
        for line in lines:
            terminalreporter.write_line(line)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Under CI every service the tests need is present, so a skipped test is a failure."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if os.environ.get("CI") and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped under CI, where it must run: {report.longrepr}"
