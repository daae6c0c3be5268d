"""SQL over the pets table: one function per statement, connection first, rows as dicts.

PostgreSQL writes each Pet's JSON itself, with the SQL function pet_json (sql/0004_pet_json.sql:
an unstated status is left out), in the shape of schemas.PetSchema: the service sends those
bytes as they come, with no Python object per pet on the way.

A page's LIMIT is written into its statement, not sent as a parameter: PostgreSQL plans a
prepared statement's `limit $n` for a tenth of the rows it could return, a cost that grows with
the table, so past about a million pets it re-planned every page for want of a cheap generic
plan, and the first page at any size. With the number in the text, each page size has its own
prepared statement whose generic plan is the custom one, planned once per connection
(docs/performance.rst says what it gained).
"""

from __future__ import annotations

import functools
from typing import Any

from psycopg import sql

from petstore.db import Connection


@functools.lru_cache(maxsize=256)
def with_limit(statement: str, limit: int) -> str:
    """`statement` with its `{limit}` replaced by the number `limit`: one text per page size."""
    return sql.SQL(statement).format(limit=sql.Literal(int(limit))).as_string(None)


def list_pets(conn: Connection, *, after: int, limit: int) -> dict[str, Any]:
    """One keyset page over the primary key: {"pets": JSON array text, "count", "last_id"}."""
    row = conn.execute(
        with_limit(
            """
            select coalesce(json_agg(pet_json(id, name, category_id, status) order by id),
                            '[]')::text as pets,
                   count(*) as count,
                   max(id) as last_id
              from (select id, name, category_id, status
                      from pets
                     where id > %(after)s
                     order by id
                     limit {limit}) page
            """,
            limit,
        ),
        {"after": after},
    ).fetchone()
    assert row is not None
    return row


def list_pets_by_status(conn: Connection, *, status: str, after: int, limit: int) -> dict[str, Any]:
    """One keyset page of one status over (status, id): {"pets", "count", "last_id"}."""
    row = conn.execute(
        with_limit(
            """
            select coalesce(json_agg(pet_json(id, name, category_id, status) order by id),
                            '[]')::text as pets,
                   count(*) as count,
                   max(id) as last_id
              from (select id, name, category_id, status
                      from pets
                     where status = %(status)s
                       and id > %(after)s
                     order by id
                     limit {limit}) page
            """,
            limit,
        ),
        {"status": status, "after": after},
    ).fetchone()
    assert row is not None
    return row


def find_pet(conn: Connection, pet_id: int) -> str | None:
    """The JSON of the pet with this id, or None."""
    row = conn.execute(
        """
        select pet_json(id, name, category_id, status)::text as pet
          from pets
         where id = %(pet_id)s
        """,
        {"pet_id": pet_id},
    ).fetchone()
    return None if row is None else str(row["pet"])


def insert_pet(
    conn: Connection, *, name: str, category_id: int, status: str | None
) -> dict[str, Any]:
    """Store a new pet: {"id", "pet": its JSON}."""
    row = conn.execute(
        """
        insert into pets (name, category_id, status)
        values (%(name)s, %(category_id)s, %(status)s)
        returning id,
                  pet_json(id, name, category_id, status)::text as pet
        """,
        {"name": name, "category_id": category_id, "status": status},
    ).fetchone()
    assert row is not None
    return row
