"""The migrations runner (petstore.migrations): lock timeout and retries, migrations outside a
transaction, their own statement timeout, and `petstore db status`."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from click.testing import CliRunner, Result

from petstore import migrations
from petstore.cli import main
from tests.support.databases import empty_database

Cli = Callable[..., Result]

ADD_COLUMN = "alter table pets add column note text;\n"
LONG_REPORT = "select count(*) from pets"
CONCURRENT_INDEX = (
    "-- petstore: no transaction\n"
    "-- the index of the tests, built without blocking writes\n"
    "create index concurrently if not exists pets_name_test_idx on pets (name);\n"
)


@pytest.fixture
def migrated_url(database_url: str) -> Iterator[str]:
    """A new database with every migration of sql/ applied."""
    with empty_database(database_url, "_migrations") as url:
        result = CliRunner().invoke(main, ["db", "upgrade"], env={"DATABASE_URL": url})
        assert result.exit_code == 0, result.output
        yield url


@pytest.fixture
def cli(migrated_url: str) -> Cli:
    def run(*args: str, **environ: str) -> Result:
        env = {"DATABASE_URL": migrated_url, **environ}
        return CliRunner().invoke(main, list(args), env=env)

    return run


def write(directory: Path, name: str, text: str) -> Path:
    directory.mkdir(exist_ok=True)
    (directory / name).write_text(text, encoding="utf-8")
    return directory


def has_column(url: str) -> bool:
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "select count(*) from information_schema.columns "
            "where table_name = 'pets' and column_name = 'note'"
        ).fetchone()
    assert row is not None
    return bool(row[0])


def test_a_migration_gives_up_in_one_line_when_its_lock_is_held_and_the_rerun_finishes(
    cli: Cli, migrated_url: str, tmp_path: Path
) -> None:
    directory = write(tmp_path / "sql", "9001_pet_note.sql", ADD_COLUMN)
    limits = {"PETSTORE_MIGRATION_LOCK_WAIT_MS": "300", "PETSTORE_MIGRATION_RETRIES": "2"}
    waits: list[float] = []
    stop = threading.Event()

    def query_pets() -> None:
        """What the service does meanwhile: reads of pets, each timed."""
        with psycopg.connect(migrated_url, autocommit=True) as reader:
            while not stop.is_set():
                started = time.monotonic()
                reader.execute("select count(*) from pets")
                waits.append(time.monotonic() - started)
                time.sleep(0.01)

    with psycopg.connect(migrated_url, application_name="long-report") as holder:
        holder.execute(LONG_REPORT)  # its transaction stays open: a lock on pets
        reader = threading.Thread(target=query_pets)
        reader.start()
        try:
            started = time.monotonic()
            gave_up = cli("db", "upgrade", "--directory", str(directory), **limits)
            took = time.monotonic() - started
        finally:
            stop.set()
            reader.join(timeout=10)
        holder_pid = holder.info.backend_pid

    assert gave_up.exit_code == 1, gave_up.output
    # Before it, a note per attempt goes to the log (tests/system/test_online_migrations.py).
    lines = [line for line in gave_up.stderr.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, gave_up.stderr
    expected = (
        rf"Error: migration 9001_pet_note\.sql gave up after 3 attempts of 300 ms "
        rf"\(PETSTORE_MIGRATION_LOCK_WAIT_MS\): it waited for AccessExclusiveLock on relation "
        rf"pets, held by pid {holder_pid} \(long-report, idle in transaction since .*: "
        rf"{re.escape(LONG_REPORT)}\); nothing of it is applied: run `petstore db upgrade` again "
        rf"once that ends"
    )
    assert re.fullmatch(expected, lines[0]), lines[0]
    # Three waits of 300 ms and pauses of 0.5 s and 1 s between them.
    assert 2.4 < took < 10
    assert not has_column(migrated_url)
    assert cli("db", "status", "--directory", str(directory)).exit_code == 4
    # The reads queued behind the waiting ALTER TABLE, never longer than its lock timeout.
    assert len(waits) > 10
    assert max(waits) < 0.3 + 0.25, sorted(waits)[-5:]

    rerun = cli("db", "upgrade", "--directory", str(directory), **limits)

    assert rerun.exit_code == 0, rerun.output
    assert rerun.stdout.strip() == "applied: 9001_pet_note.sql"
    assert has_column(migrated_url)


def index_is_valid(url: str, name: str) -> bool | None:
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "select i.indisvalid from pg_index i join pg_class c on c.oid = i.indexrelid "
            "where c.relname = %s",
            [name],
        ).fetchone()
    return None if row is None else bool(row[0])


def test_a_migration_outside_a_transaction_builds_its_index_again_when_a_build_left_it_invalid(
    cli: Cli, migrated_url: str, tmp_path: Path
) -> None:
    with psycopg.connect(migrated_url, autocommit=True) as conn:
        conn.execute("insert into pets (name, category_id) values ('Rex', 1), ('Rex', 1)")
        # A build that fails half-way (here: not unique) leaves its index behind, INVALID.
        with pytest.raises(psycopg.errors.UniqueViolation):
            conn.execute("create unique index concurrently pets_name_test_idx on pets (name)")
    assert index_is_valid(migrated_url, "pets_name_test_idx") is False
    directory = write(tmp_path / "sql", "9002_pets_name_index.sql", CONCURRENT_INDEX)

    applied = cli("db", "upgrade", "--directory", str(directory))

    assert applied.exit_code == 0, applied.output
    assert applied.stdout.strip() == "applied: 9002_pets_name_index.sql"
    assert index_is_valid(migrated_url, "pets_name_test_idx") is True
    assert cli("db", "status", "--directory", str(directory)).exit_code == 0


def test_migrations_have_their_own_statement_timeout(
    cli: Cli, migrated_url: str, tmp_path: Path
) -> None:
    directory = write(tmp_path / "sql", "9003_slow.sql", "select pg_sleep(1);\n" + ADD_COLUMN)

    # The service's statement timeout (50 ms) does not cut a migration.
    slow = cli(
        "db",
        "upgrade",
        "--directory",
        str(directory),
        PETSTORE_DB_STATEMENT_TIMEOUT_MS="50",
        PETSTORE_MIGRATION_TIMEOUT_MS="200",
    )

    assert slow.exit_code == 1
    assert "canceling statement due to statement timeout" in slow.stderr
    assert not has_column(migrated_url)

    done = cli(
        "db", "upgrade", "--directory", str(directory), PETSTORE_DB_STATEMENT_TIMEOUT_MS="50"
    )

    assert done.exit_code == 0, done.output
    assert has_column(migrated_url)


def test_db_status_lists_applied_and_pending_migrations(cli: Cli, tmp_path: Path) -> None:
    shipped = [m.name for m in migrations.migrations()]

    current = cli("db", "status")
    directory = write(tmp_path / "sql", "9001_pet_note.sql", ADD_COLUMN)
    behind = cli("db", "status", "--directory", str(directory))

    assert current.exit_code == 0, current.output
    assert current.stdout.splitlines() == [f"applied  {name}" for name in shipped]
    assert behind.exit_code == 4
    assert behind.stdout.splitlines()[-1] == "pending  9001_pet_note.sql"
    assert behind.stderr.strip() == "Error: 1 migration pending: run `petstore db upgrade`"


def test_statements_split_at_the_semicolons_that_end_them() -> None:
    text = (
        "-- petstore: no transaction\n"
        "create function f() returns text language sql as $$ select 'a;b' $$;\n"
        "/* a comment; still one */ select ';' as \"x;y\";\n"
        "-- the end; nothing follows\n"
    )

    assert migrations.statements(text) == [
        "-- petstore: no transaction\n"
        "create function f() returns text language sql as $$ select 'a;b' $$",
        "/* a comment; still one */ select ';' as \"x;y\"",
    ]


def test_squawk_is_told_which_migrations_run_outside_a_transaction() -> None:
    """`make lint` lints each file as the runner applies it: in a transaction unless squawk is told
    otherwise in the file (the Makefile's SQUAWK_FLAGS)."""
    for migration in migrations.migrations():
        told = "-- squawk-disable-assume-in-transaction" in migration.text.splitlines()
        assert told is not migration.in_transaction, migration.name
