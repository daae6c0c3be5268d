"""`petstore usage` (requests per key and day) and `petstore audit` (the operators' actions)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, date, datetime, time, timedelta
from typing import Any

import click
from click.decorators import FC

from petstore.cli import common
from petstore.plans import PLAN_LIMITS, PLANS
from petstore.queries import audit as audit_sql
from petstore.queries import keys as key_sql
from petstore.queries import usage as usage_sql

FORMATS = click.Choice(["table", "csv", "json"])
FORMAT = click.option("--format", "output", type=FORMATS, default="table", show_default=True)
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
AUDIT_COLUMNS = {
    "at": "at",
    "command": "command",
    "key_id": "key",
    "os_user": "user",
    "reason": "reason",
}


def key_option(text: str) -> Callable[[FC], FC]:
    """--key ID, parsed as a KEY_ID is; `text` is its help."""
    return click.option("--key", "key_id", metavar="ID", callback=common.parse_key_id, help=text)


def parse_day(option: str, text: str | None, default: date) -> date:
    """A --since/--until UTC date (YYYY-MM-DD); `default` when not given; BadInput otherwise."""
    if text is None:
        return default
    try:
        return date.fromisoformat(text.strip())
    except ValueError:
        raise common.BadInput(f"{option} {text!r}: expected a date such as 2026-11-26") from None


def usage_row(row: dict[str, Any]) -> dict[str, Any]:
    """A key's day as `petstore usage` shows it: the share of its daily limit used (every answered
    request spends the daily budget, a 429 does not: it is refused for want of it)."""
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


@click.command("usage")
@key_option("Only this key.")
@click.option("--plan", type=click.Choice(PLANS), help="Only the keys of this plan.")
@click.option("--since", help="The first UTC day (YYYY-MM-DD), included; default: 6 days ago.")
@click.option("--until", help="The last UTC day (YYYY-MM-DD), included; default: today.")
@click.option(
    "--top",
    type=click.IntRange(min=1),
    help="Only the N keys closest to their daily limit: each one's busiest day.",
)
@FORMAT
def usage(
    key_id: int | None,
    plan: str | None,
    since: str | None,
    until: str | None,
    top: int | None,
    output: str,
) -> None:
    """Requests per key and UTC day, by outcome, with the share of each key's daily limit used."""
    if key_id is not None and plan is not None:
        raise common.BadInput("give --key or --plan, not both")
    last = parse_day("--until", until, datetime.now(UTC).date())
    first = parse_day("--since", since, last - timedelta(days=6))
    if last < first:
        raise common.BadInput(f"--since {first} is after --until {last}")
    with common.database() as conn:
        if key_id is not None and key_sql.find_key(conn, key_id) is None:
            raise common.NoSuchKey(f"no key with id {key_id}")
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
    common.emit(shown, USAGE_COLUMNS, output)


@click.command("audit")
@key_option("Only the actions on this key.")
@click.option("--since", help="From this UTC day (YYYY-MM-DD) on.")
@FORMAT
def audit(key_id: int | None, since: str | None, output: str) -> None:
    """The operator actions of the `petstore` command, oldest first: when, what, key, who, why."""
    first = None if since is None else parse_day("--since", since, date.today())
    with common.database() as conn:
        rows = audit_sql.list_audit(
            conn, key_id, None if first is None else datetime.combine(first, time(), UTC)
        )
    common.emit([{**row, "at": row["at"].astimezone(UTC)} for row in rows], AUDIT_COLUMNS, output)
