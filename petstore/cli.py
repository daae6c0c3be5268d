"""The `petstore` command: db, keys, bans, openapi and serve (make run's server: petstore/devserver.py)."""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import click
import psycopg

from petstore import auth, config, db, devserver, migrations, openapi, views
from petstore.queries import bans, idempotency, keys
from petstore.queries import usage as usage_sql
from petstore.ratelimit.bans import clear_strikes
from petstore.ratelimit.plans import PLANS

FROM_MAKE_RUN = "petstore.cli.from_make_run"


def load_settings() -> dict[str, Any]:
    """The settings; without DATABASE_URL, the embedded database `make run` recorded (said on stderr)."""
    try:
        settings = config.from_environ()
        if not settings["DATABASE_URL"] and (recorded := devserver.recorded_database_url()):
            settings["DATABASE_URL"], path = recorded
            settings[FROM_MAKE_RUN] = True
            click.echo(
                f"DATABASE_URL is not set: using the embedded database of `make run`, "
                f"{settings['DATABASE_URL']} (from {path})",
                err=True,
            )
        config.check(settings)
    except config.ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    return settings


@contextlib.contextmanager
def database(settings: dict[str, Any] | None = None) -> Iterator[db.Connection]:
    """A connection for one command; PostgreSQL's complaints become a one-line error, not a traceback."""
    settings = settings or load_settings()
    try:
        conn = db.connect(settings)
    except psycopg.Error as exc:
        reason = " ".join(str(exc).split())
        hint = (
            "; the embedded PostgreSQL runs while `make run` serves: start it, or set DATABASE_URL"
            if settings.get(FROM_MAKE_RUN)
            else ""
        )
        raise click.ClickException(f"cannot connect to PostgreSQL: {reason}{hint}") from None
    try:
        with conn:
            yield conn
    except psycopg.Error as exc:
        raise click.ClickException(f"PostgreSQL: {exc}") from None


@click.group()
def main() -> None:
    """The Animal Store service."""


@main.group("db")
def db_group() -> None:
    """The database schema."""


MIGRATIONS_DIRECTORY = click.option(
    "--directory",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="The migrations of this directory instead of sql/ (for drills and tests).",
)


@db_group.command("upgrade")
@MIGRATIONS_DIRECTORY
def db_upgrade(directory: Path | None) -> None:
    """Apply the migrations not yet applied (safe to run concurrently).

    Connects to PETSTORE_MIGRATION_DATABASE_URL when set (required behind a transaction pooler,
    whose connections cannot hold the migrations' session lock), else to DATABASE_URL. A
    migration that cannot get its lock gives up in one line naming it (exit status 1).
    """
    settings = load_settings()
    pooled = db.behind_transaction_pooler(settings)
    direct_url = settings["MIGRATION_DATABASE_URL"]
    if pooled and not direct_url:
        raise click.ClickException(
            "PETSTORE_DB_POOLER=transaction: set PETSTORE_MIGRATION_DATABASE_URL to a direct "
            "URL of PostgreSQL (not the pooler) for migrations"
        )
    direct = {
        **settings,
        "DATABASE_URL": direct_url or settings["DATABASE_URL"],
        "DB_POOLER": "none",
    }
    with database(direct) as conn:
        try:
            limits = migrations.Limits.from_settings(settings)
            # Pinned whatever PETSTORE_DB_POOLER says, so that a database which gains a
            # transaction pooler later keeps its statement timeout (a direct connection sets its
            # own anyway).
            applied = migrations.upgrade(
                conn, limits, directory, settings["DB_STATEMENT_TIMEOUT_MS"]
            )
        except migrations.GaveUp as exc:
            raise click.ClickException(str(exc)) from None
    click.echo(f"applied: {', '.join(applied)}" if applied else "schema is up to date")


@db_group.command("status")
@MIGRATIONS_DIRECTORY
def db_status(directory: Path | None) -> None:
    """List the migrations applied and those pending (exit status 4 when some are pending)."""
    with database() as conn:
        done = migrations.applied(conn)
        waiting = migrations.pending(conn, directory)
    for name in done:
        click.echo(f"applied  {name}")
    for migration in waiting:
        click.echo(f"pending  {migration.name}")
    if waiting:
        raise NothingToDo(
            f"{len(waiting)} migration{'s' if len(waiting) != 1 else ''} pending: "
            "run `petstore db upgrade`"
        )


@db_group.command("prune")
def db_prune() -> None:
    """Delete idempotency records older than 24 hours, and usage counts older than
    PETSTORE_USAGE_RETENTION_DAYS (run it daily, e.g. from cron)."""
    settings = load_settings()
    kept_from = datetime.now(UTC) - timedelta(days=settings["USAGE_RETENTION_DAYS"])
    with database(settings) as conn:
        deleted = idempotency.delete_expired(conn)
        hours = usage_sql.delete_usage_before(conn, kept_from)
    click.echo(f"deleted {deleted} expired idempotency records")
    click.echo(
        f"deleted {hours} usage rows older than {settings['USAGE_RETENTION_DAYS']} days "
        "(PETSTORE_USAGE_RETENTION_DAYS)"
    )


@main.group("keys")
def keys_group() -> None:
    """API keys."""


# Exit statuses, one per kind of outcome, the same for every command (README.rst, "The command
# line"): 0 done; 1 the command could not run (a setting, PostgreSQL, the limiter storage);
# 2 a usage error; 3 no such key; 4 nothing to do. Each refusal is one line on stderr.


class BadInput(click.ClickException):
    """Input the command refuses before changing anything: one line on stderr, exit status 2."""

    exit_code = 2


class NoSuchKey(click.ClickException):
    """The key the command names does not exist (or, to rotate, is not live): exit status 3."""

    exit_code = 3


class NothingToDo(click.ClickException):
    """What the command would do is done already: nothing changed, exit status 4."""

    exit_code = 4


def parse_key_id(text: str) -> int:
    """A KEY_ID argument: a whole number that a key id can be (bigint); BadInput otherwise."""
    if not text.isdigit() or not 0 < int(text) <= 2**63 - 1:
        raise BadInput(f"KEY_ID {text!r} is not a key id: expected a whole number such as 12")
    return int(text)


DURATION = re.compile(r"([0-9]{1,9})([dhm])")
DURATION_UNITS = {"d": 86400, "h": 3600, "m": 60}


def parse_duration(option: str, text: str) -> int:
    """Seconds of a duration such as 90d, 24h or 30m (more than zero); BadInput otherwise."""
    match = DURATION.fullmatch(text.strip())
    if match is None or int(match[1]) == 0:
        raise BadInput(
            f"{option} {text!r}: expected a positive number of days, hours or minutes, "
            "such as 90d, 24h or 30m"
        )
    return int(match[1]) * DURATION_UNITS[match[2]]


def parse_expiry(expires_in: str | None, expires_at: str | None) -> datetime | None:
    """When a new key expires, from --expires-in or --expires-at (ISO 8601; UTC unless it says)."""
    if expires_in is not None and expires_at is not None:
        raise BadInput("give --expires-in or --expires-at, not both")
    now = datetime.now(UTC)
    if expires_in is not None:
        return now + timedelta(seconds=parse_duration("--expires-in", expires_in))
    if expires_at is None:
        return None
    try:
        instant = datetime.fromisoformat(expires_at.strip())
    except ValueError:
        raise BadInput(
            f"--expires-at {expires_at!r}: expected an ISO 8601 date and time, "
            "such as 2027-01-31T12:00:00Z"
        ) from None
    if instant.tzinfo is None:
        instant = instant.replace(tzinfo=UTC)
    if instant <= now:
        raise BadInput(f"--expires-at {expires_at}: that is not in the future")
    return instant


def parse_scopes(given: tuple[str, ...]) -> tuple[str, ...]:
    """The scopes of --scope (repeatable, or comma-separated); both when none is given."""
    scopes = tuple(dict.fromkeys(part.strip() for text in given for part in text.split(",")))
    unknown = [scope for scope in scopes if scope not in auth.SCOPES]
    if unknown:
        raise BadInput(f"--scope {unknown[0]!r} is not a scope: use {' or '.join(auth.SCOPES)}")
    return scopes or auth.SCOPES


@keys_group.command("create")
@click.option("--plan", type=click.Choice(PLANS), required=True)
@click.option("--label", default="", help="A note to recognise the key by.")
@click.option(
    "--per-minute", type=click.IntRange(min=1), help="Requests per minute (enterprise: required)."
)
@click.option(
    "--per-day", type=click.IntRange(min=1), help="Requests per day (enterprise: required)."
)
@click.option("--expires-in", help="Expire after this long: 90d, 24h, 30m (default: never).")
@click.option("--expires-at", help="Expire at this ISO 8601 instant (UTC unless it says).")
@click.option(
    "--scope",
    "scopes",
    multiple=True,
    help="read (list and get) or write (create); repeatable. Default: read and write.",
)
def keys_create(
    plan: str,
    label: str,
    per_minute: int | None,
    per_day: int | None,
    expires_in: str | None,
    expires_at: str | None,
    scopes: tuple[str, ...],
) -> None:
    """Create a key; it is printed once, alone on the last line, and stored only hashed."""
    if plan == "enterprise" and (per_minute is None or per_day is None):
        raise click.UsageError("an enterprise key needs both --per-minute and --per-day")
    expiry = parse_expiry(expires_in, expires_at)
    wanted = parse_scopes(scopes)
    with database() as conn:
        key, row = auth.issue_key(conn, plan, label, per_minute, per_day, expiry, wanted)
    expiring = f", expires {row['expires_at']:%Y-%m-%d %H:%M:%S%z}" if row["expires_at"] else ""
    click.echo(
        f"created key {row['id']} ({row['prefix']}..., plan {row['plan']}, "
        f"scope {' '.join(row['scopes'])}{expiring}); it is shown only now:"
    )
    click.echo(key)


@keys_group.command("list")
def keys_list() -> None:
    """Every key: id, prefix, plan, numbers, label, state."""
    with database() as conn:
        rows = keys.list_keys(conn)
    click.echo(
        f"{'id':>6}  {'prefix':<12} {'plan':<10} {'/minute':>8} {'/day':>9}  {'state':<8} "
        f"{'scope':<10} {'expires':<24} label"
    )
    for row in rows:
        if row["revoked_at"]:
            state = "revoked"
        elif row["expired"]:
            state = "expired"
        else:
            state = "live"
        expires = f"{row['expires_at']:%Y-%m-%d %H:%M:%S%z}" if row["expires_at"] else "never"
        click.echo(
            f"{row['id']:>6}  {row['prefix']:<12} {row['plan']:<10} "
            f"{row['per_minute'] or '-':>8} {row['per_day'] or '-':>9}  {state:<8} "
            f"{','.join(row['scopes']):<10} {expires:<24} {row['label']}"
        )


@keys_group.command("revoke")
@click.argument("key_text", metavar="KEY_ID")
def keys_revoke(key_text: str) -> None:
    """Revoke a key now; its next request gets 401."""
    key_id = parse_key_id(key_text)
    with database() as conn:
        if not keys.revoke_key(conn, key_id):
            if keys.find_key(conn, key_id) is None:
                raise NoSuchKey(f"no key with id {key_id}: nothing revoked")
            raise NothingToDo(f"key {key_id} is revoked already: nothing to do")
    click.echo(f"revoked key {key_id}")


@keys_group.command("rotate")
@click.argument("key_text", metavar="KEY_ID")
@click.option(
    "--grace",
    default="24h",
    show_default=True,
    help="How long the old secret keeps working: 24h, 7d, 30m.",
)
def keys_rotate(key_text: str, grace: str) -> None:
    """A new secret for the same key (same id, plan, limits, budgets and bans); printed once."""
    key_id = parse_key_id(key_text)
    grace_seconds = parse_duration("--grace", grace)
    with database() as conn:
        rotated = auth.rotate_key(conn, key_id, grace_seconds)
    if rotated is None:
        raise NoSuchKey(f"no live key with id {key_id} (unknown or revoked): nothing rotated")
    key, row = rotated
    click.echo(
        f"rotated key {row['id']} ({row['prefix']}..., plan {row['plan']}); the old secret works "
        f"until {row['previous_valid_until']:%Y-%m-%d %H:%M:%S%z}; the new one is shown only now:"
    )
    click.echo(key)


@main.group("bans")
def bans_group() -> None:
    """Bans of keys that kept calling after 429."""


@bans_group.command("list")
def bans_list() -> None:
    """Every ban, newest first: active ones and past ones."""
    with database() as conn:
        rows = bans.list_bans(conn)
    click.echo(f"{'key':>6}  {'prefix':<12} {'banned at':<25} {'until':<25} {'seconds':>7}  state")
    for row in rows:
        if row["active"]:
            state = "active"
        elif row["lifted_at"]:
            state = f"lifted {row['lifted_at']:%Y-%m-%d %H:%M:%S%z}"
        else:
            state = "ended"
        click.echo(
            f"{row['key_id']:>6}  {row['prefix']:<12} {row['banned_at']:%Y-%m-%d %H:%M:%S%z}  "
            f"{row['banned_until']:%Y-%m-%d %H:%M:%S%z}  {row['seconds']:>7}  {state}"
        )


@bans_group.command("lift")
@click.argument("key_text", metavar="KEY_ID")
def bans_lift(key_text: str) -> None:
    """End the key's active ban now, and forgive its strikes: it starts again from a full threshold.

    The key's row is stamped (strikes_forgiven_at): strikes counted before the stamp no longer
    count in any worker, whatever the limiter storage, memory:// included. A key with strikes but
    no active ban has them forgiven (exit status 0).
    """
    key_id = parse_key_id(key_text)
    settings = load_settings()
    with database(settings) as conn, conn.transaction():
        stamps = bans.forgive_strikes(conn, key_id)
        if stamps is None:
            raise NoSuchKey(f"no key with id {key_id}: nothing lifted")
        lifted = bans.lift_bans(conn, key_id)
    in_memory = settings["RATELIMIT_STORAGE_URI"].startswith("memory://")
    strikes = None
    if not in_memory:
        try:
            # Forgiven by the stamp already; cleared too, so that nothing reads them again.
            strikes = clear_strikes(settings, key_id, stamps["before"])
        except Exception as exc:
            click.echo(
                f"the strikes of key {key_id} are forgiven but could not be cleared in the rate "
                f"limit storage ({type(exc).__name__}: {exc}); they expire with their window",
                err=True,
            )
    if lifted:
        click.echo(f"lifted the ban of key {key_id} and cleared its strikes")
    elif strikes:
        click.echo(
            f"key {key_id} has no active ban; cleared its {strikes} "
            f"strike{'s' if strikes != 1 else ''}: it starts again from a full threshold"
        )
    elif strikes is None:
        click.echo(
            f"key {key_id} has no active ban; its strikes, if any, no longer count in any "
            "worker: it starts again from a full threshold"
        )
    else:
        raise NothingToDo(f"key {key_id} has no active ban and no strikes: nothing to do")


@main.command("serve")
@click.option("--bind", envvar="BIND", default="127.0.0.1:8000", show_default=True)
@click.option(
    "--var-dir",
    envvar="PETSTORE_VAR_DIR",
    default="var",
    show_default=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Where the embedded PostgreSQL keeps its data.",
)
def serve(bind: str, var_dir: Path) -> None:
    """Development server: database (embedded unless DATABASE_URL), migrations, a key, gunicorn.

    Refuses, in one line and before touching anything, a bad setting, another `make run` of this
    checkout, and an address another program listens on (petstore/devserver.py).
    """
    with devserver.serving(bind, var_dir):
        settings = load_settings()
        kept_in = var_dir.resolve() / devserver.DEV_KEY_FILE
        with database(settings) as conn:
            migrations.upgrade(conn, migrations.Limits.from_settings(settings))
            key, key_id, kept = devserver.development_key(conn, kept_in)
        devserver.print_welcome(settings["DATABASE_URL"], bind, key, key_id, kept, kept_in)
        sys.stdout.flush()
        sys.exit(devserver.run_gunicorn(bind))


@main.command("openapi")
def openapi_document() -> None:
    """Print the OpenAPI document that GET /v1/openapi.json serves (JSON; no database needed)."""
    try:
        settings = config.from_environ()
    except config.ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(openapi.to_json(openapi.build_document(settings, views.described())), nl=False)
