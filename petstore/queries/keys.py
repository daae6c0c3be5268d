"""SQL over the api_keys table."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from petstore import tracing
from petstore.db import Connection


@tracing.statement
def find_key_by_hash(conn: Connection, key_hash: bytes) -> dict[str, Any] | None:
    """The unrevoked key with this secret's hash: id, plan, per-key numbers, scopes (separated by
    spaces), when it expires, when the grace of the previous secret it was found by ends, and
    the end of any active ban (each None for never), and when its strikes were last forgiven.

    The hash is the key's current secret, or its previous one within the grace of a rotation.
    An expired key is returned too, so that its 401 can say so. Instants rather than whether
    they have passed, so that a row kept for a while (petstore.keycache) is judged at each
    request. One query for all of it, so that checking expiry, scopes and bans costs no second
    round trip.
    """
    return conn.execute(
        """
        select k.id,
               k.plan,
               k.per_minute,
               k.per_day,
               array_to_string(k.scopes, ' ') as scopes,
               k.expires_at,
               k.strikes_forgiven_at,
               case when k.key_hash = %(key_hash)s then null
                    else k.previous_valid_until
               end as grace_until,
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
         where (k.key_hash = %(key_hash)s
                or (k.previous_key_hash = %(key_hash)s and k.previous_valid_until > now()))
           and k.revoked_at is null
        """,
        {"key_hash": key_hash},
    ).fetchone()


@tracing.statement
def insert_key(
    conn: Connection,
    *,
    key_hash: bytes,
    prefix: str,
    label: str,
    plan: str,
    per_minute: int | None,
    per_day: int | None,
    expires_at: datetime | None = None,
    scopes: Sequence[str] = ("read", "write"),
) -> dict[str, Any]:
    """Store a new key (its hash only) and return its row."""
    row = conn.execute(
        """
        insert into api_keys (key_hash, prefix, label, plan, per_minute, per_day, expires_at,
                              scopes)
        values (%(key_hash)s, %(prefix)s, %(label)s, %(plan)s, %(per_minute)s, %(per_day)s,
                %(expires_at)s, %(scopes)s)
        returning id, prefix, label, plan, per_minute, per_day, created_at, expires_at, scopes
        """,
        {
            "key_hash": key_hash,
            "prefix": prefix,
            "label": label,
            "plan": plan,
            "per_minute": per_minute,
            "per_day": per_day,
            "expires_at": expires_at,
            "scopes": list(scopes),
        },
    ).fetchone()
    assert row is not None
    return row


@tracing.statement
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
               revoked_at,
               expires_at,
               coalesce(expires_at <= now(), false) as expired,
               scopes
          from api_keys
         order by id
        """
    ).fetchall()


@tracing.statement
def find_key(conn: Connection, key_id: int) -> dict[str, Any] | None:
    """The key with this id, live or revoked (id, revoked_at); None when there is none."""
    return conn.execute(
        """
        select id,
               revoked_at
          from api_keys
         where id = %(key_id)s
        """,
        {"key_id": key_id},
    ).fetchone()


@tracing.statement
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


@tracing.statement
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


@tracing.statement
def rotate_key(
    conn: Connection, key_id: int, *, key_hash: bytes, prefix: str, grace_seconds: int
) -> dict[str, Any] | None:
    """Give an unrevoked key a new secret; its current one stays valid for `grace_seconds`.

    The row, and so its id, plan, numbers and every budget and ban keyed by that id, stays the
    same. None when there is no such unrevoked key.
    """
    return conn.execute(
        """
        update api_keys
           set previous_key_hash = key_hash,
               previous_valid_until = now() + make_interval(secs => %(grace_seconds)s),
               key_hash = %(key_hash)s,
               prefix = %(prefix)s
         where id = %(key_id)s
           and revoked_at is null
        returning id, prefix, plan, previous_valid_until
        """,
        {"key_id": key_id, "key_hash": key_hash, "prefix": prefix, "grace_seconds": grace_seconds},
    ).fetchone()
