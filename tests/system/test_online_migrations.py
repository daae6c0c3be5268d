"""Migrations while the service serves (issue 28 §1): on a million pets under a mixed load, an
index built concurrently and a column added cost no error and hold no answer as long as the lock
wait (the p99s before and during are printed); a migration
that cannot get its lock gives up, and the load never waits longer than its lock timeout.

The migrations are the test's own (a directory it passes to `petstore db upgrade --directory`),
not shipped in sql/.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from petstore import config, db, keys, migrations
from tests.support.checks import Answer
from tests.support.databases import empty_database
from tests.support.load import MixedLoad
from tests.support.servers import Gunicorn

PETSTORE = Path(sys.executable).parent / "petstore"
SEEDED = 1_000_000

ADD_COLUMN = "alter table pets add column online_note text;\n"
INDEX_CONCURRENTLY = (
    "-- petstore: no transaction\n"
    "create index concurrently if not exists pets_online_name_idx on pets (name);\n"
)


@pytest.fixture(scope="module")
def million_pets(database_url: str) -> Iterator[str]:
    """A migrated database with a million pets, seeded by one generate_series (seconds)."""
    with empty_database(database_url, "_online") as url:
        with db.connect(config.from_environ({"DATABASE_URL": url})) as conn:
            migrations.upgrade(conn)
            conn.execute("set statement_timeout = 0")
            started = time.monotonic()
            conn.execute(
                """
                insert into pets (name, category_id, status)
                select 'seed-' || i, 1 + i %% 7, 'available'
                  from generate_series(1, %s) as i
                """,
                [SEEDED],
            )
            conn.execute("analyze pets")
            print(f"\nseeded {SEEDED:,} pets in {time.monotonic() - started:.1f} s")
        yield url


@pytest.fixture
def key(million_pets: str) -> str:
    with db.connect(config.from_environ({"DATABASE_URL": million_pets})) as conn:
        secret, _row = keys.issue_key(conn, "enterprise", "online", 1_000_000, 10_000_000)
    return secret


def migration_directory(tmp_path: Path, **files: str) -> Path:
    directory = tmp_path / "migrations"
    directory.mkdir()
    for name, text in files.items():
        (directory / f"{name}.sql").write_text(text, encoding="utf-8")
    return directory


def upgrade(url: str, directory: Path, **environ: str) -> subprocess.CompletedProcess[str]:
    """`petstore db upgrade --directory` as the operator runs it, timed by the caller."""
    return subprocess.run(
        [str(PETSTORE), "db", "upgrade", "--directory", str(directory)],
        env={**os.environ, "DATABASE_URL": url, **environ},
        capture_output=True,
        text=True,
        timeout=300,
    )


def p99(answers: list[Answer]) -> float:
    times = sorted(answer.elapsed for answer in answers)
    assert len(times) >= 100, len(times)
    return times[int(len(times) * 0.99)]


def assert_clean(load: MixedLoad, url: str) -> None:
    """No error, no connection failure, every 201 a row and no create given up."""
    statuses = {answer.status for answer in load.answers}
    assert load.failures == []
    assert statuses <= {200, 201}, sorted(statuses)
    assert load.abandoned == []
    rows = load.rows(lambda: db.connect(config.from_environ({"DATABASE_URL": url})))
    assert sum(rows.values()) == len(load.created) == len(set(load.created))
    assert all(count == 1 for count in rows.values())


# Clients of the mixed load while a migration runs, each sending its next request on an answer.
LOAD_CLIENTS = 4


def test_an_index_built_concurrently_and_a_column_added_under_load_cost_no_error(
    million_pets: str, key: str, tmp_path: Path
) -> None:
    directory = migration_directory(
        tmp_path,
        **{"9101_pets_online_note": ADD_COLUMN, "9102_pets_online_name": INDEX_CONCURRENTLY},
    )
    environ = {"DATABASE_URL": million_pets, "RATELIMIT_STORAGE_URI": "memory://"}
    with Gunicorn(environ, tmp_path / "gunicorn.log", workers=1, threads=8) as server:
        # A busy service, not a saturated one: on this 2-core machine 8 clients without pause
        # leave no core free, and then anything else that runs (the migration's own process
        # starting) doubles the latency whatever the migration locks.
        before = MixedLoad(server.url, key, "before", clients=LOAD_CLIENTS)
        before.run(1200)

        with MixedLoad(server.url, key, "during", clients=LOAD_CLIENTS).running() as during:
            time.sleep(1)  # the load is running before the migration starts
            started = time.monotonic()
            done = upgrade(million_pets, directory)
            finished = time.monotonic()
            time.sleep(0.5)
    took = finished - started
    in_window = [a for a in during.answers if started <= a.started <= finished]
    print(
        f"\nmigration {took:.1f} s; p99 before {p99(before.answers) * 1000:.1f} ms "
        f"({len(before.answers)} answers), during {p99(in_window) * 1000:.1f} ms "
        f"({len(in_window)} answers)"
    )

    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "applied: 9101_pets_online_note.sql, 9102_pets_online_name.sql"
    assert_clean(before, million_pets)
    assert_clean(during, million_pets)
    # Nothing waited behind the migration's locks longer than its lock wait (2 s by default).
    # The p99s above are reported, not compared: on 2 cores a window of 2-3 s holds a thousand
    # answers, and the migration's own process starting moves its p99 by more than any lock
    # does (docs/upgrading.rst gives measured runs).
    assert max(answer.elapsed for answer in in_window) < 2.0 + 0.5
    with psycopg.connect(million_pets) as conn:
        valid = conn.execute(
            "select i.indisvalid from pg_index i join pg_class c on c.oid = i.indexrelid "
            "where c.relname = 'pets_online_name_idx'"
        ).fetchone()
    assert valid == (True,)


def test_a_migration_behind_a_long_transaction_gives_up_and_the_load_never_waits_longer(
    million_pets: str, key: str, tmp_path: Path
) -> None:
    directory = migration_directory(
        tmp_path, **{"9103_pets_blocked": ADD_COLUMN.replace("online_note", "blocked_note")}
    )
    lock_timeout_ms = 500
    limits = {
        "PETSTORE_MIGRATION_LOCK_WAIT_MS": str(lock_timeout_ms),
        "PETSTORE_MIGRATION_RETRIES": "2",
    }
    environ = {"DATABASE_URL": million_pets, "RATELIMIT_STORAGE_URI": "memory://"}
    with Gunicorn(environ, tmp_path / "gunicorn.log", workers=1, threads=8) as server:
        load = MixedLoad(server.url, key, "blocked", clients=8)
        with psycopg.connect(million_pets, application_name="long-report") as holder:
            holder.execute("select count(*) from pets where category_id = 1")  # stays open
            with load.running():
                time.sleep(1)
                started = time.monotonic()
                gave_up = upgrade(million_pets, directory, **limits)
                finished = time.monotonic()
            holder_pid = holder.info.backend_pid
        rerun = upgrade(million_pets, directory, **limits)
    in_window = [a for a in load.answers if started <= a.started <= finished]
    slowest = max(a.elapsed for a in in_window)
    print(
        f"\ngave up after {finished - started:.1f} s: {gave_up.stderr.strip()}\n"
        f"slowest answer meanwhile {slowest * 1000:.0f} ms ({len(in_window)} answers), "
        f"lock timeout {lock_timeout_ms} ms"
    )

    assert gave_up.returncode == 1
    *retries, last = gave_up.stderr.strip().splitlines()
    # A note for each attempt that waited in vain, then the one line that gives up.
    assert len(retries) == 2, gave_up.stderr
    assert all(
        note.startswith("migration 9103_pets_blocked.sql: no lock within 500 ms")
        for note in retries
    ), retries
    assert last.startswith(
        "Error: migration 9103_pets_blocked.sql gave up after 3 attempts of 500 ms "
        "(PETSTORE_MIGRATION_LOCK_WAIT_MS): it waited for AccessExclusiveLock on relation "
        f"pets, held by pid {holder_pid} (long-report, idle in transaction since "
    ), last
    assert_clean(load, million_pets)
    # Queued behind the waiting ALTER TABLE at most its lock timeout, plus the request itself.
    assert slowest < lock_timeout_ms / 1000 + 0.4
    assert rerun.returncode == 0, rerun.stderr
    assert rerun.stdout.strip() == "applied: 9103_pets_blocked.sql"
