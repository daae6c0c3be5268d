"""SQL over the bans table."""

from __future__ import annotations

from typing import Any

from petstore import tracing
from petstore.db import Connection


@tracing.statement
def insert_ban(
    conn: Connection,
    *,
    key_id: int,
    base_seconds: int,
    strikes: int,
    escalation: int,
    max_seconds: int,
    repeat_seconds: int,
) -> dict[str, Any] | None:
    """Ban a key unless it is banned already; None then.

    The length is `base_seconds`, or `escalation` times the previous ban's (capped at
    `max_seconds`) when that one ended less than `repeat_seconds` ago. Run it in a
    transaction: it takes a lock on the key so that two workers cannot ban it twice.
    """
    conn.execute("select pg_advisory_xact_lock(%(key_id)s)", {"key_id": key_id})
    return conn.execute(
        """
        with previous as (
            select seconds,
                   coalesce(lifted_at, banned_until) as ended_at
              from bans
             where key_id = %(key_id)s
             order by banned_at desc
             limit 1
        ),
        length as (
            select coalesce(
                       (select least(seconds * %(escalation)s, %(max_seconds)s)
                          from previous
                         where ended_at > now() - make_interval(secs => %(repeat_seconds)s)),
                       %(base_seconds)s
                   ) as seconds
        )
        insert into bans (key_id, banned_until, seconds, strikes)
        select %(key_id)s,
               now() + make_interval(secs => length.seconds),
               length.seconds,
               %(strikes)s
          from length
         where not exists (
                   select 1
                     from bans
                    where key_id = %(key_id)s
                      and banned_until > now()
                      and lifted_at is null
               )
        returning id, key_id, banned_at, banned_until, seconds
        """,
        {
            "key_id": key_id,
            "base_seconds": base_seconds,
            "strikes": strikes,
            "escalation": escalation,
            "max_seconds": max_seconds,
            "repeat_seconds": repeat_seconds,
        },
    ).fetchone()


@tracing.statement
def list_bans(conn: Connection) -> list[dict[str, Any]]:
    """Every ban, newest first, with whether it is still in force."""
    return conn.execute(
        """
        select b.id,
               b.key_id,
               k.prefix,
               b.banned_at,
               b.banned_until,
               b.seconds,
               b.strikes,
               b.lifted_at,
               (b.banned_until > now() and b.lifted_at is null) as active
          from bans b
          join api_keys k on k.id = b.key_id
         order by b.banned_at desc, b.id desc
        """
    ).fetchall()


@tracing.statement
def lift_bans(conn: Connection, key_id: int) -> int:
    """End the key's active bans now; return how many were lifted."""
    cur = conn.execute(
        """
        update bans
           set lifted_at = now()
         where key_id = %(key_id)s
           and banned_until > now()
           and lifted_at is null
        """,
        {"key_id": key_id},
    )
    return cur.rowcount


@tracing.statement
def forgive_strikes(conn: Connection, key_id: int) -> dict[str, Any] | None:
    """Stamp the key's strikes as forgiven now: (before, after), its previous stamp and the new
    one; None for no such key."""
    return conn.execute(
        """
        update api_keys k
           set strikes_forgiven_at = now()
          from (select id,
                       strikes_forgiven_at
                  from api_keys
                 where id = %(key_id)s
                   for update) old
         where k.id = old.id
        returning old.strikes_forgiven_at as before,
                  k.strikes_forgiven_at as after
        """,
        {"key_id": key_id},
    ).fetchone()
