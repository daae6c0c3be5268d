"""The `petstore` command: db, keys, bans, usage, audit, openapi and serve (make run's server:
petstore/devserver.py)."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import re
import sys
from collections.abc import Iterator
from datetime import UTC, date, datetime, time, timedelta
from pathlib import Path
from typing import Any

import click
import psycopg

from petstore import audit, config, db, devserver, keys, migrations, openapi, views
from petstore.plans import PLAN_LIMITS, PLANS
from petstore.queries import audit as audit_sql
from petstore.queries import bans, idempotency
from petstore.queries import keys as key_sql
from petstore.queries import usage as usage_sql
from petstore.ratelimit.bans import clear_strikes

FROM_MAKE_RUN = "petstore.cli.from_make_run"

REASON = click.option("--reason", help="Why: kept in the audit trail (petstore audit).")


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


# Exit statuses, one per kind of outcome, the same for every command (docs/cli.rst, "Exit
# statuses"): 0 done; 1 the command could not run (a setting, PostgreSQL, the limiter storage);
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
    unknown = [scope for scope in scopes if scope not in keys.SCOPES]
    if unknown:
        raise BadInput(f"--scope {unknown[0]!r} is not a scope: use {' or '.join(keys.SCOPES)}")
    return scopes or keys.SCOPES


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
@REASON
def keys_create(
    plan: str,
    label: str,
    per_minute: int | None,
    per_day: int | None,
    expires_in: str | None,
    expires_at: str | None,
    scopes: tuple[str, ...],
    reason: str | None,
) -> None:
    """Create a key; it is printed once, alone on the last line, and stored only hashed."""
    if plan == "enterprise" and (per_minute is None or per_day is None):
        raise click.UsageError("an enterprise key needs both --per-minute and --per-day")
    expiry = parse_expiry(expires_in, expires_at)
    wanted = parse_scopes(scopes)
    with database() as conn, conn.transaction():
        key, row = keys.issue_key(conn, plan, label, per_minute, per_day, expiry, wanted)
        audit.record(conn, "keys create", row["id"], reason)
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
        rows = key_sql.list_keys(conn)
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
@REASON
def keys_revoke(key_text: str, reason: str | None) -> None:
    """Revoke a key now; its next request gets 401."""
    key_id = parse_key_id(key_text)
    with database() as conn, conn.transaction():
        if not key_sql.revoke_key(conn, key_id):
            if key_sql.find_key(conn, key_id) is None:
                raise NoSuchKey(f"no key with id {key_id}: nothing revoked")
            raise NothingToDo(f"key {key_id} is revoked already: nothing to do")
        audit.record(conn, "keys revoke", key_id, reason)
    click.echo(f"revoked key {key_id}")


@keys_group.command("rotate")
@click.argument("key_text", metavar="KEY_ID")
@click.option(
    "--grace",
    default="24h",
    show_default=True,
    help="How long the old secret keeps working: 24h, 7d, 30m.",
)
@REASON
def keys_rotate(key_text: str, grace: str, reason: str | None) -> None:
    """A new secret for the same key (same id, plan, limits, budgets and bans); printed once."""
    key_id = parse_key_id(key_text)
    grace_seconds = parse_duration("--grace", grace)
    with database() as conn, conn.transaction():
        rotated = keys.rotate_key(conn, key_id, grace_seconds)
        if rotated is None:
            raise NoSuchKey(f"no live key with id {key_id} (unknown or revoked): nothing rotated")
        audit.record(conn, "keys rotate", key_id, reason)
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
@REASON
def bans_lift(key_text: str, reason: str | None) -> None:
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
        audit.record(conn, "bans lift", key_id, reason)
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
    given = bool(os.environ.get("DATABASE_URL"))
    with devserver.serving(bind, var_dir):
        settings = load_settings()
        kept_in = var_dir.resolve() / devserver.DEV_KEY_FILE
        with database(settings) as conn:
            migrations.upgrade(conn, migrations.Limits.from_settings(settings))
            key, key_id, kept = devserver.development_key(conn, kept_in)
        devserver.print_welcome(settings["DATABASE_URL"], given, bind, key, key_id, kept, kept_in)
        sys.stdout.flush()
        sys.exit(devserver.run_gunicorn(bind))


@main.command("openapi")
def openapi_document() -> None:
    """Print the OpenAPI document that GET /v1/openapi.json serves (JSON; no database needed)."""
    try:
        settings = config.from_environ()
    except config.ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(openapi.to_json(openapi.build_document(settings, views.RESOURCES)), nl=False)


FORMATS = click.Choice(["table", "csv", "json"])


def parse_day(option: str, text: str | None, default: date) -> date:
    """A --since/--until UTC date (YYYY-MM-DD); `default` when not given; BadInput otherwise."""
    if text is None:
        return default
    try:
        return date.fromisoformat(text.strip())
    except ValueError:
        raise BadInput(f"{option} {text!r}: expected a date such as 2026-11-26") from None


def emit(rows: list[dict[str, Any]], columns: dict[str, str], output: str) -> None:
    """Rows as an aligned table, CSV or JSON (a list of objects); `columns`: key -> heading."""
    if output == "json":
        click.echo(json.dumps(rows, default=str, indent=2))
        return
    if output == "csv":
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows([["" if row[c] is None else row[c] for c in columns] for row in rows])
        click.echo(buffer.getvalue(), nl=False)
        return
    cells = [[("-" if row[c] is None else str(row[c])) for c in columns] for row in rows]
    widths = [
        max([len(heading), *(len(line[i]) for line in cells)])
        for i, heading in enumerate(columns.values())
    ]
    for line in [list(columns.values()), *cells]:
        click.echo(
            "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        )


USAGE_COLUMNS = {
    "key_id": "key",
    "plan": "plan",
    "day": "day",
    "requests": "requests",
    "2xx": "2xx",
    "4xx": "4xx",
    "429": "429",
    "5xx": "5xx",
    "per_day": "limit/day",
    "used_percent": "used %",
}


def usage_row(row: dict[str, Any]) -> dict[str, Any]:
    """A key's day as `petstore usage` shows it: the share of its daily limit used.

    Every answered request spends the daily budget, a 429 does not (it is refused for want of it).
    """
    per_day = row["per_day"] or PLAN_LIMITS.get(row["plan"], (0, 0))[1]
    spent = row["requests_2xx"] + row["requests_4xx"] + row["requests_5xx"]
    return {
        "key_id": row["key_id"],
        "plan": row["plan"],
        "day": row["day"].isoformat(),
        "requests": spent + row["requests_429"],
        "2xx": row["requests_2xx"],
        "4xx": row["requests_4xx"],
        "429": row["requests_429"],
        "5xx": row["requests_5xx"],
        "per_day": per_day or None,
        "used_percent": round(100 * spent / per_day, 1) if per_day else None,
    }


@main.command("usage")
@click.option("--key", "key_text", metavar="ID", help="Only this key.")
@click.option("--plan", type=click.Choice(PLANS), help="Only the keys of this plan.")
@click.option("--since", help="The first UTC day (YYYY-MM-DD), included; default: 6 days ago.")
@click.option("--until", help="The last UTC day (YYYY-MM-DD), included; default: today.")
@click.option(
    "--top",
    type=click.IntRange(min=1),
    help="Only the N keys closest to their daily limit: each one's busiest day.",
)
@click.option("--format", "output", type=FORMATS, default="table", show_default=True)
def usage_command(
    key_text: str | None,
    plan: str | None,
    since: str | None,
    until: str | None,
    top: int | None,
    output: str,
) -> None:
    """Requests per key and UTC day, by outcome, with the share of each key's daily limit used."""
    if key_text is not None and plan is not None:
        raise BadInput("give --key or --plan, not both")
    key_id = None if key_text is None else parse_key_id(key_text)
    last = parse_day("--until", until, datetime.now(UTC).date())
    first = parse_day("--since", since, last - timedelta(days=6))
    if last < first:
        raise BadInput(f"--since {first} is after --until {last}")
    with database() as conn:
        if key_id is not None and key_sql.find_key(conn, key_id) is None:
            raise NoSuchKey(f"no key with id {key_id}")
        rows = usage_sql.daily_usage(
            conn,
            datetime.combine(first, time(), UTC),
            datetime.combine(last + timedelta(days=1), time(), UTC),
            key_id,
            plan,
        )
    shown = [usage_row(row) for row in rows]
    if top is not None:
        busiest: dict[int, dict[str, Any]] = {}
        for row in shown:
            best = busiest.get(row["key_id"])
            if best is None or (row["used_percent"] or 0) > (best["used_percent"] or 0):
                busiest[row["key_id"]] = row
        shown = sorted(busiest.values(), key=lambda row: -(row["used_percent"] or 0))[:top]
    emit(shown, USAGE_COLUMNS, output)


AUDIT_COLUMNS = {
    "at": "at",
    "command": "command",
    "key_id": "key",
    "os_user": "user",
    "reason": "reason",
}


@main.command("audit")
@click.option("--key", "key_text", metavar="ID", help="Only the actions on this key.")
@click.option("--since", help="From this UTC day (YYYY-MM-DD) on.")
@click.option("--format", "output", type=FORMATS, default="table", show_default=True)
def audit_command(key_text: str | None, since: str | None, output: str) -> None:
    """The operator actions of the `petstore` command, oldest first: when, what, key, who, why."""
    key_id = None if key_text is None else parse_key_id(key_text)
    first = None if since is None else parse_day("--since", since, date.today())
    with database() as conn:
        rows = audit_sql.list_audit(
            conn, key_id, None if first is None else datetime.combine(first, time(), UTC)
        )
    shown = [{**row, "at": f"{row['at'].astimezone(UTC):%Y-%m-%d %H:%M:%S%z}"} for row in rows]
    for row in shown:
        row.pop("id")
    emit(shown, AUDIT_COLUMNS, output)
