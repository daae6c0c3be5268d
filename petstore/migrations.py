"""The migrations runner: `petstore db upgrade` and `petstore db status` (sql/, docs/upgrading.rst).

Each migration waits at most MIGRATION_LOCK_WAIT_MS for a lock, so that the queries queued
behind it (every later query on the table it locks) wait no longer than that either. When it
cannot get its lock it is rolled back, and tried again after a pause, MIGRATION_RETRIES
times; then the upgrade gives up with one line naming the lock and the session that holds it.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from petstore import db
from petstore.db import Connection

log = logging.getLogger(__name__)

# pg_advisory_lock key held while migrating, so that two `petstore db upgrade` wait for each other.
MIGRATION_LOCK = 0x7065_7473_746F_7265 >> 1  # "petstore", kept inside bigint

MIGRATION_NAME = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")

# A migration whose first line is this runs outside a transaction, one statement at a time
# (CREATE INDEX CONCURRENTLY refuses a transaction block). Its statements must be safe to run
# again (IF NOT EXISTS): after a failure, the rerun starts from its first one.
NO_TRANSACTION = "-- petstore: no transaction"

# An index that CREATE INDEX CONCURRENTLY names: when the build failed half-way it is left
# INVALID, and IF NOT EXISTS would keep it so; the rerun drops it first.
CONCURRENT_INDEX = re.compile(
    r"create\s+(?:unique\s+)?index\s+concurrently\s+(?:if\s+not\s+exists\s+)?([a-z_][a-z0-9_]*)",
    re.IGNORECASE,
)

# The pause before the next attempt after a lock timeout: doubled each time, from this.
FIRST_PAUSE = 0.5
# The longest one wait for the migration lock lasts before it is taken anew (take_migration_lock).
LOCK_POLL_MS = 200
# How often the lock watcher looks at what the migration waits for.
WATCH_INTERVAL = 0.05


@dataclass(frozen=True)
class Migration:
    """One file of sql/: its name without .sql is the schema version it brings."""

    name: str
    text: str

    @property
    def in_transaction(self) -> bool:
        """Whether it runs as one transaction (unless its first line says otherwise)."""
        return not self.text.lstrip().startswith(NO_TRANSACTION)


@dataclass(frozen=True)
class Limits:
    """The migrations' own timeouts and retries (the PETSTORE_MIGRATION_* settings)."""

    lock_timeout_ms: int = 2000
    lock_retries: int = 4
    statement_timeout_ms: int = 3_600_000

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> Limits:
        """The limits the settings give."""
        return cls(
            settings["MIGRATION_LOCK_WAIT_MS"],
            settings["MIGRATION_RETRIES"],
            settings["MIGRATION_TIMEOUT_MS"],
        )


class GaveUp(Exception):
    """A migration did not get its lock within the retries: nothing of it is applied."""


def migrations(directory: Traversable | Path | None = None) -> list[Migration]:
    """Every numbered migration of `directory` (default: sql/, shipped as petstore/sql), in order."""
    files = directory or resources.files("petstore").joinpath("sql")
    names = sorted(f.name for f in files.iterdir() if MIGRATION_NAME.match(f.name))
    return [Migration(name, files.joinpath(name).read_text(encoding="utf-8")) for name in names]


def applied(conn: Connection) -> list[str]:
    """Names of the migrations applied to the database, in order (none before the first upgrade)."""
    exists = conn.execute("select to_regclass('schema_migrations') is not null as e").fetchone()
    if exists is None or not exists["e"]:
        return []
    rows = conn.execute("select name from schema_migrations order by name").fetchall()
    return [row["name"] for row in rows]


def schema_version(conn: Connection) -> str | None:
    """The database's schema: the newest migration applied, its file name without .sql."""
    row = conn.execute("select max(name) as name from schema_migrations").fetchone()
    return row["name"].removesuffix(".sql") if row and row["name"] else None


def pending(conn: Connection, directory: Traversable | Path | None = None) -> list[Migration]:
    """The migrations of `directory` (default: sql/) not yet applied to the database."""
    done = set(applied(conn))
    return [m for m in migrations(directory) if m.name not in done]


def refusal(settings: dict[str, Any]) -> str | None:
    """Why this code must not serve the database of `settings` (migrations it needs are missing).

    None when the database has them all, and when it does not answer: then the service starts and
    answers 503 until it does (wsgi.py says so), as it would after a restart of PostgreSQL.
    """
    try:
        with db.connect(settings) as conn:
            missing = [m.name for m in pending(conn)]
    except psycopg.Error:
        return None
    if not missing:
        return None
    return (
        f"the database lacks the migration{'s' if len(missing) > 1 else ''} "
        f"{', '.join(missing)} that this version of the code needs: run `petstore db upgrade` "
        "first (docs/upgrading.rst)"
    )


def upgrade(
    conn: Connection,
    limits: Limits | None = None,
    directory: Traversable | Path | None = None,
    statement_timeout_ms: int | None = None,
) -> list[str]:
    """Apply the migrations not yet applied, in order; return their names. With
    `statement_timeout_ms`, then pin it on the database (db.pin_statement_timeout), under the
    same lock: two concurrent ALTER DATABASE of one row fail ("tuple concurrently updated").

    It holds a session-level advisory lock: `conn` must be a direct connection to PostgreSQL,
    never one through a transaction pooler (PETSTORE_MIGRATION_DATABASE_URL). Raises GaveUp
    when a migration cannot get its lock: the ones before it stay applied, it is not.
    """
    limits = limits or Limits()
    applied_now = []
    # Waiting for another upgrade may take longer than any statement timeout: none while waiting.
    conn.execute("set statement_timeout = 0")
    take_migration_lock(conn)
    try:
        with conn.transaction():
            conn.execute(
                """
                create table if not exists schema_migrations (
                    name       text primary key,
                    applied_at timestamptz not null default now()
                )
                """
            )
        conn.execute(sql.SQL("set statement_timeout = {}").format(limits.statement_timeout_ms))
        conn.execute(sql.SQL("set lock_timeout = {}").format(limits.lock_timeout_ms))
        # An index built while the service serves takes one core, not PostgreSQL's default of
        # a leader and two workers, which on a small server leave the requests none.
        conn.execute("set max_parallel_maintenance_workers = 0")
        for migration in pending(conn, directory):
            started = time.monotonic()
            apply_with_retries(conn, migration, limits)
            log.info("applied migration %s in %.1f s", migration.name, time.monotonic() - started)
            applied_now.append(migration.name)
        if statement_timeout_ms is not None:
            try:
                db.pin_statement_timeout(conn, statement_timeout_ms)
            except psycopg.errors.InsufficientPrivilege as exc:
                # Migrated all the same: a missing pin is reported by the service, not an outage.
                log.warning("the statement timeout is not pinned on the database: %s", exc)
    finally:
        conn.execute("reset statement_timeout")
        conn.execute("reset lock_timeout")
        conn.execute("reset max_parallel_maintenance_workers")
        conn.execute("select pg_advisory_unlock(%s)", [MIGRATION_LOCK])
    return applied_now


def take_migration_lock(conn: Connection) -> None:
    """Wait for the migration lock as long as it takes, in waits of LOCK_POLL_MS each.

    A statement blocked on the lock holds a snapshot, and CREATE INDEX CONCURRENTLY, in the
    upgrade that holds the lock, waits for every transaction with an older snapshot to end: one
    wait with no end would be a deadlock between the two (PostgreSQL ends it, failing the
    waiting upgrade). A wait that times out ends its snapshot, and the next one's is newer.
    """
    conn.execute(sql.SQL("set lock_timeout = {}").format(LOCK_POLL_MS))
    while True:
        try:
            conn.execute("select pg_advisory_lock(%s)", [MIGRATION_LOCK])
            return
        except psycopg.errors.LockNotAvailable:
            continue


def apply_with_retries(conn: Connection, migration: Migration, limits: Limits) -> None:
    """Apply one migration; after a lock timeout, pause and try again, then give up (GaveUp)."""
    pause = FIRST_PAUSE
    for attempt in range(1, limits.lock_retries + 2):
        with LockWatcher(conn) as watcher:
            try:
                apply(conn, migration)
                return
            except psycopg.errors.LockNotAvailable:
                waited_for = watcher.seen or "a lock (its holder ended before it could be seen)"
        if attempt > limits.lock_retries:
            raise GaveUp(
                f"migration {migration.name} gave up after {attempt} attempts of "
                f"{limits.lock_timeout_ms} ms (PETSTORE_MIGRATION_LOCK_WAIT_MS): it waited "
                f"for {waited_for}; nothing of it is applied: run `petstore db upgrade` again "
                "once that ends"
            )
        log.warning(
            "migration %s: no lock within %d ms (attempt %d), waited for %s; again in %.1f s",
            migration.name,
            limits.lock_timeout_ms,
            attempt,
            waited_for,
            pause,
        )
        time.sleep(pause)
        pause *= 2


def apply(conn: Connection, migration: Migration) -> None:
    """Run one migration and record it: in one transaction, or statement by statement."""
    if migration.in_transaction:
        with conn.transaction():
            conn.execute(migration.text.encode())
            conn.execute("insert into schema_migrations (name) values (%s)", [migration.name])
        return
    for index in CONCURRENT_INDEX.findall(migration.text):
        drop_if_invalid(conn, index)
    for statement in statements(migration.text):
        conn.execute(statement.encode())
    conn.execute("insert into schema_migrations (name) values (%s)", [migration.name])


def drop_if_invalid(conn: Connection, index: str) -> None:
    """Drop `index` when a build that failed half-way left it INVALID, so that it is built again."""
    row = conn.execute(
        """
        select not i.indisvalid as invalid
          from pg_index i join pg_class c on c.oid = i.indexrelid
         where c.relname = %s and pg_table_is_visible(c.oid)
        """,
        [index],
    ).fetchone()
    if row is not None and row["invalid"]:
        log.warning(
            "dropping the INVALID index %s left by a failed build, to build it again", index
        )
        conn.execute(sql.SQL("drop index concurrently if exists {}").format(sql.Identifier(index)))


# Quoted text, dollar-quoted bodies and comments, in which a semicolon ends nothing.
_SKIPPED = re.compile(
    r"'(?:[^']|'')*'|\"(?:[^\"]|\"\")*\"|(\$[a-zA-Z_0-9]*\$).*?\1|--[^\n]*|/\*.*?\*/", re.DOTALL
)


def statements(text: str) -> list[str]:
    """The statements of a migration's text, split at the semicolons that end them."""
    found = []
    start = position = 0
    while position < len(text):
        skipped = _SKIPPED.match(text, position)
        if skipped:
            position = skipped.end()
        elif text[position] == ";":
            found.append(text[start:position])
            start = position = position + 1
        else:
            position += 1
    found.append(text[start:])
    return [s.strip() for s in found if _SKIPPED.sub("", s).strip()]


class LockWatcher:
    """While a migration runs, another connection notes the lock it waits for and who holds it."""

    def __init__(self, conn: Connection) -> None:
        self.pid = conn.info.backend_pid
        self.conninfo = conn.info.dsn
        self.password = conn.info.password
        self.seen: str | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="lock-watcher", daemon=True)

    def __enter__(self) -> LockWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        try:
            with psycopg.connect(
                self.conninfo,
                password=self.password,
                autocommit=True,
                application_name="petstore-migration-watcher",
            ) as watcher:
                while not self._done.wait(WATCH_INTERVAL):
                    self.seen = describe_wait(watcher, self.pid) or self.seen
        except psycopg.Error as exc:
            log.warning("the migration's lock watcher stopped: %s", exc)


def describe_wait(conn: psycopg.Connection[Any], pid: int) -> str | None:
    """The lock `pid` waits for and the sessions holding it, in words; None when it waits for none."""
    row = conn.execute(
        """
        select l.mode, l.locktype,
               coalesce(l.relation::regclass::text, l.virtualxid, l.transactionid::text, '?'),
               (select string_agg(
                         format('pid %%s (%%s, %%s since %%s: %%s)', a.pid,
                                coalesce(nullif(a.application_name, ''), a.usename), a.state,
                                to_char(a.xact_start, 'YYYY-MM-DD HH24:MI:SS TZ'),
                                left(regexp_replace(a.query, '\\s+', ' ', 'g'), 80)),
                         ', ')
                  from pg_stat_activity a
                 where a.pid = any(pg_blocking_pids(l.pid)))
          from pg_locks l
         where l.pid = %s and not l.granted
         limit 1
        """,
        [pid],
    ).fetchone()
    if row is None:
        return None
    mode, locktype, what, holders = row
    target = f"relation {what}" if locktype == "relation" else f"{locktype} {what}"
    return f"{mode} on {target}, held by {holders or 'a session that has ended'}"
