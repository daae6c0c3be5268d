"""`petstore db`: upgrade, status and prune."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import click

from petstore import db, migrations
from petstore.cli import common
from petstore.queries import idempotency
from petstore.queries import usage as usage_sql

group = click.Group("db", help="The database schema.")


MIGRATIONS_DIRECTORY = click.option(
    "--directory",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="The migrations of this directory instead of sql/ (for drills and tests).",
)


@group.command("upgrade")
@MIGRATIONS_DIRECTORY
def db_upgrade(directory: Path | None) -> None:
    """Apply the migrations not yet applied (safe to run concurrently).

    Connects to PETSTORE_MIGRATION_DATABASE_URL when set (required behind a transaction pooler,
    whose connections cannot hold the migrations' session lock), else to DATABASE_URL. A
    migration that cannot get its lock gives up in one line naming it (exit status 1).
    """
    settings = common.load_settings()
    direct_url = settings["MIGRATION_DATABASE_URL"]
    if db.behind_transaction_pooler(settings) and not direct_url:
        raise click.ClickException(
            "PETSTORE_DB_POOLER=transaction: set PETSTORE_MIGRATION_DATABASE_URL to a direct "
            "URL of PostgreSQL (not the pooler) for migrations"
        )
    direct = {
        **settings,
        "DATABASE_URL": direct_url or settings["DATABASE_URL"],
        "DB_POOLER": "none",
    }
    with common.database(direct) as conn:
        try:
            limits = migrations.Limits.from_settings(settings)
            # Pinned whatever PETSTORE_DB_POOLER says: a database may gain a transaction pooler
            # later (a direct connection sets its own timeout anyway).
            applied = migrations.upgrade(
                conn, limits, directory, settings["DB_STATEMENT_TIMEOUT_MS"]
            )
        except migrations.GaveUp as exc:
            raise click.ClickException(str(exc)) from None
    click.echo(f"applied: {', '.join(applied)}" if applied else "schema is up to date")


@group.command("status")
@MIGRATIONS_DIRECTORY
def db_status(directory: Path | None) -> None:
    """List the migrations applied and those pending (exit status 4 when some are pending)."""
    with common.database() as conn:
        done = migrations.applied(conn)
        waiting = migrations.pending(conn, directory)
    for name in done:
        click.echo(f"applied  {name}")
    for migration in waiting:
        click.echo(f"pending  {migration.name}")
    if waiting:
        raise common.NothingToDo(
            f"{len(waiting)} migration{'s' if len(waiting) != 1 else ''} pending: "
            "run `petstore db upgrade`"
        )


@group.command("prune")
def db_prune() -> None:
    """Delete idempotency records older than 24 hours, and usage counts older than
    PETSTORE_USAGE_RETENTION_DAYS (run it daily, e.g. from cron)."""
    settings = common.load_settings()
    kept_from = datetime.now(UTC) - timedelta(days=settings["USAGE_RETENTION_DAYS"])
    with common.database(settings) as conn:
        deleted = idempotency.delete_expired(conn)
        hours = usage_sql.delete_usage_before(conn, kept_from)
    click.echo(f"deleted {deleted} expired idempotency records")
    click.echo(
        f"deleted {hours} usage rows older than {settings['USAGE_RETENTION_DAYS']} days "
        "(PETSTORE_USAGE_RETENTION_DAYS)"
    )
