"""SQL over the api_keys table."""

from __future__ import annotations

from typing import Any

from petstore.db import Connection


def find_key_by_hash(conn: Connection, key_hash: bytes) -> dict[str, Any] | None:
    """The live key with this hash: id, plan, per-key numbers and the end of any active ban.

    One query for both, so that checking bans costs no second round trip.
    """
    return conn.execute(
        """
        select k.id,
               k.plan,
               k.per_minute,
               k.per_day,
               b.banned_until
          from api_keys k
          left join lateral (
                   select banned_until
                     from bans
                    where key_id = k.id
                      and banned_until > now()
                      and lifted_at is null
                    order by banned_until desc
                    limit 1
               ) b on true
         where k.key_hash = %(key_hash)s
           and k.revoked_at is null
        """,
        {"key_hash": key_hash},
    ).fetchone()


def insert_key(
    conn: Connection,
    *,
    key_hash: bytes,
    prefix: str,
    label: str,
    plan: str,
    per_minute: int | None,
    per_day: int | None,
) -> dict[str, Any]:
    """Store a new key (its hash only) and return its row."""
    row = conn.execute(
        """
        insert into api_keys (key_hash, prefix, label, plan, per_minute, per_day)
        values (%(key_hash)s, %(prefix)s, %(label)s, %(plan)s, %(per_minute)s, %(per_day)s)
        returning id, prefix, label, plan, per_minute, per_day, created_at
        """,
        {
            "key_hash": key_hash,
            "prefix": prefix,
            "label": label,
            "plan": plan,
            "per_minute": per_minute,
            "per_day": per_day,
        },
    ).fetchone()
    assert row is not None
    return row


def list_keys(conn: Connection) -> list[dict[str, Any]]:
    """Every key, live and revoked, oldest first."""
    return conn.execute(
        """
        select id,
               prefix,
               label,
               plan,
               per_minute,
               per_day,
               created_at,
               revoked_at
          from api_keys
         order by id
        """
    ).fetchall()


def revoke_key(conn: Connection, key_id: int) -> bool:
    """Revoke a live key now; False when there is no such live key."""
    cur = conn.execute(
        """
        update api_keys
           set revoked_at = now()
         where id = %(key_id)s
           and revoked_at is null
        """,
        {"key_id": key_id},
    )
    return cur.rowcount == 1


def revoke_keys_labelled(conn: Connection, label: str) -> int:
    """Revoke every live key with this label; return how many."""
    cur = conn.execute(
        """
        update api_keys
           set revoked_at = now()
         where label = %(label)s
           and revoked_at is null
        """,
        {"label": label},
    )
    return cur.rowcount
