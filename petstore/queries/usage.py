"""SQL over key_usage: requests per key, UTC hour and outcome."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from petstore import tracing
from petstore.db import Connection

# The outcomes a request is counted by, in the order of key_usage's columns.
OUTCOMES = ("2xx", "4xx", "429", "5xx")


@tracing.statement
def add_usage(conn: Connection, rows: Sequence[tuple[int, datetime, int, int, int, int]]) -> None:
    """Add (key_id, hour, 2xx, 4xx, 429, 5xx) rows to the counts, in one statement.

    The rows come sorted by (key_id, hour): two workers adding to the same rows lock them in the
    same order, so they wait for each other and never deadlock.
    """
    key_ids, hours, ok, client, limited, server = (
        list(column) for column in zip(*rows, strict=True)
    )
    conn.execute(
        """
        insert into key_usage (key_id, hour, requests_2xx, requests_4xx, requests_429, requests_5xx)
        select *
          from unnest(%(key_ids)s::bigint[], %(hours)s::timestamptz[], %(ok)s::bigint[],
                      %(client)s::bigint[], %(limited)s::bigint[], %(server)s::bigint[])
        on conflict (key_id, hour) do update
           set requests_2xx = key_usage.requests_2xx + excluded.requests_2xx,
               requests_4xx = key_usage.requests_4xx + excluded.requests_4xx,
               requests_429 = key_usage.requests_429 + excluded.requests_429,
               requests_5xx = key_usage.requests_5xx + excluded.requests_5xx
        """,
        {
            "key_ids": key_ids,
            "hours": hours,
            "ok": ok,
            "client": client,
            "limited": limited,
            "server": server,
        },
    )


@tracing.statement
def usage_of_key(
    conn: Connection, key_id: int, since: datetime, until: datetime, granularity: str
) -> list[dict[str, Any]]:
    """The key's counts per `granularity` (hour or day) from `since` to before `until`, oldest first."""
    return conn.execute(
        """
        select date_trunc(%(granularity)s, hour, 'UTC') as start,
               sum(requests_2xx)::bigint as requests_2xx,
               sum(requests_4xx)::bigint as requests_4xx,
               sum(requests_429)::bigint as requests_429,
               sum(requests_5xx)::bigint as requests_5xx
          from key_usage
         where key_id = %(key_id)s
           and hour >= %(since)s
           and hour < %(until)s
         group by 1
         order by 1
        """,
        {"granularity": granularity, "key_id": key_id, "since": since, "until": until},
    ).fetchall()


@tracing.statement
def daily_usage(
    conn: Connection,
    since: datetime,
    until: datetime,
    key_id: int | None = None,
    plan: str | None = None,
) -> list[dict[str, Any]]:
    """Per key and UTC day, from `since` to before `until`: the counts, the key's plan and its own
    daily limit (null: its plan's); one key or one plan's keys when given. No aggregate row."""
    return conn.execute(
        """
        select u.key_id,
               k.plan,
               k.per_day,
               (date_trunc('day', u.hour, 'UTC') at time zone 'UTC')::date as day,
               sum(u.requests_2xx)::bigint as requests_2xx,
               sum(u.requests_4xx)::bigint as requests_4xx,
               sum(u.requests_429)::bigint as requests_429,
               sum(u.requests_5xx)::bigint as requests_5xx
          from key_usage as u
          join api_keys as k on k.id = u.key_id
         where u.hour >= %(since)s
           and u.hour < %(until)s
           and (%(key_id)s::bigint is null or u.key_id = %(key_id)s)
           and (%(plan)s::text is null or k.plan::text = %(plan)s)
         group by u.key_id, k.plan, k.per_day, 4
         order by 4, u.key_id
        """,
        {"since": since, "until": until, "key_id": key_id, "plan": plan},
    ).fetchall()


@tracing.statement
def delete_usage_before(conn: Connection, before: datetime) -> int:
    """Delete the counts of hours before `before`; return how many rows."""
    return conn.execute(
        "delete from key_usage where hour < %(before)s", {"before": before}
    ).rowcount
