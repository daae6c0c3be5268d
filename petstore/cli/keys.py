"""`petstore keys`: create, list, revoke and rotate."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import click

from petstore import audit, keys
from petstore.cli import common
from petstore.plans import PLANS
from petstore.queries import keys as key_sql

DURATION = re.compile(r"([0-9]{1,9})([dhm])")
DURATION_UNITS = {"d": 86400, "h": 3600, "m": 60}
COLUMNS = {
    "id": "id",
    "prefix": "prefix",
    "plan": "plan",
    "per_minute": "/minute",
    "per_day": "/day",
    "state": "state",
    "scope": "scope",
    "expires": "expires",
    "label": "label",
}


group = click.Group("keys", help="API keys.")


def parse_duration(option: str, text: str) -> int:
    """Seconds of a duration such as 90d, 24h or 30m (more than zero); BadInput otherwise."""
    match = DURATION.fullmatch(text.strip())
    if match is None or int(match[1]) == 0:
        raise common.BadInput(
            f"{option} {text!r}: expected a positive number of days, hours or minutes, "
            "such as 90d, 24h or 30m"
        )
    return int(match[1]) * DURATION_UNITS[match[2]]


def parse_expiry(expires_in: str | None, expires_at: str | None) -> datetime | None:
    """When a new key expires, from --expires-in or --expires-at (ISO 8601; UTC unless it says)."""
    if expires_in is not None and expires_at is not None:
        raise common.BadInput("give --expires-in or --expires-at, not both")
    now = datetime.now(UTC)
    if expires_in is not None:
        return now + timedelta(seconds=parse_duration("--expires-in", expires_in))
    if expires_at is None:
        return None
    try:
        instant = datetime.fromisoformat(expires_at.strip())
    except ValueError:
        raise common.BadInput(
            f"--expires-at {expires_at!r}: expected an ISO 8601 date and time, "
            "such as 2027-01-31T12:00:00Z"
        ) from None
    if instant.tzinfo is None:
        instant = instant.replace(tzinfo=UTC)
    if instant <= now:
        raise common.BadInput(f"--expires-at {expires_at}: that is not in the future")
    return instant


def parse_scopes(given: tuple[str, ...]) -> tuple[str, ...]:
    """The scopes of --scope (repeatable, or comma-separated); both when none is given."""
    scopes = tuple(dict.fromkeys(part.strip() for text in given for part in text.split(",")))
    unknown = [scope for scope in scopes if scope not in keys.SCOPES]
    if unknown:
        raise common.BadInput(
            f"--scope {unknown[0]!r} is not a scope: use {' or '.join(keys.SCOPES)}"
        )
    return scopes or keys.SCOPES


@group.command("create")
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
@common.REASON
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
    with common.database() as conn, conn.transaction():
        key, row = keys.issue_key(conn, plan, label, per_minute, per_day, expiry, wanted)
        audit.record(conn, "keys create", row["id"], reason)
    expiring = f", expires {row['expires_at']:{common.INSTANT}}" if row["expires_at"] else ""
    click.echo(
        f"created key {row['id']} ({row['prefix']}..., plan {row['plan']}, "
        f"scope {' '.join(row['scopes'])}{expiring}); it is shown only now:"
    )
    click.echo(key)


@group.command("list")
def keys_list() -> None:
    """Every key: id, prefix, plan, numbers, label, state."""
    with common.database() as conn:
        rows = key_sql.list_keys(conn)
    for row in rows:
        row["state"] = "revoked" if row["revoked_at"] else "expired" if row["expired"] else "live"
        row["scope"] = ",".join(row["scopes"])
        row["expires"] = row["expires_at"] or "never"
    common.emit(rows, COLUMNS)


@group.command("revoke")
@common.KEY_ID
@common.REASON
def keys_revoke(key_id: int, reason: str | None) -> None:
    """Revoke a key now; its next request gets 401."""
    with common.database() as conn, conn.transaction():
        if not key_sql.revoke_key(conn, key_id):
            if key_sql.find_key(conn, key_id) is None:
                raise common.NoSuchKey(f"no key with id {key_id}: nothing revoked")
            raise common.NothingToDo(f"key {key_id} is revoked already: nothing to do")
        audit.record(conn, "keys revoke", key_id, reason)
    click.echo(f"revoked key {key_id}")


@group.command("rotate")
@common.KEY_ID
@click.option(
    "--grace",
    default="24h",
    show_default=True,
    help="How long the old secret keeps working: 24h, 7d, 30m.",
)
@common.REASON
def keys_rotate(key_id: int, grace: str, reason: str | None) -> None:
    """A new secret for the same key (same id, plan, limits, budgets and bans); printed once."""
    grace_seconds = parse_duration("--grace", grace)
    with common.database() as conn, conn.transaction():
        rotated = keys.rotate_key(conn, key_id, grace_seconds)
        if rotated is None:
            raise common.NoSuchKey(
                f"no live key with id {key_id} (unknown or revoked): nothing rotated"
            )
        audit.record(conn, "keys rotate", key_id, reason)
    key, row = rotated
    click.echo(
        f"rotated key {row['id']} ({row['prefix']}..., plan {row['plan']}); the old secret works "
        f"until {row['previous_valid_until']:{common.INSTANT}}; the new one is shown only now:"
    )
    click.echo(key)
