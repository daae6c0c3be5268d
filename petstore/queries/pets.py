"""SQL over the pets table: one function per statement, connection first, rows as dicts.

PostgreSQL writes each Pet's JSON itself, with the SQL function pet_json (sql/0004_pet_json.sql:
an unstated status is left out), in the shape of schemas.PetSchema: the service sends those
bytes as they come, with no Python object per pet on the way.

A page's LIMIT, and its status filter, are written into its statement, not sent as parameters:
PostgreSQL plans a prepared statement's parameters once for all their values (its generic plan).
It costs `limit $n` as a tenth of the table, a cost that grows with the table, so it planned the
first page anew at every call and the filtered page past about 100,000 pets; and `status = $1`
as any status, so on a table where one status came to dominate, the generic plan it kept read
far more rows than the one for that status. With the values in the text, each page size (and
status) has its own statement, whose only parameter, the keyset's `after`, cannot change its
plan: planned once per connection, at any size and any mix of statuses (docs/performance.rst).
"""

from __future__ import annotations

import functools
from typing import Any

from psycopg import sql

from petstore.db import Connection


@functools.lru_cache(maxsize=512)
def written(statement: str, **values: int | str) -> str:
    """`statement` with each `{name}` replaced by the literal of `values[name]`: one text per
    page size and status, made once."""
    literals = {name: sql.Literal(value) for name, value in values.items()}
    return sql.SQL(statement).format(**literals).as_string(None)


def list_pets(conn: Connection, *, after: int, limit: int) -> dict[str, Any]:
    """One keyset page over the primary key: {"pets": JSON array text, "count", "last_id"}."""
    row = conn.execute(
        written(
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
            limit=int(limit),
        ),
        {"after": after},
    ).fetchone()
    assert row is not None
    return row


def list_pets_by_status(conn: Connection, *, status: str, after: int, limit: int) -> dict[str, Any]:
    """One keyset page of one status over (status, id): {"pets", "count", "last_id"}."""
    row = conn.execute(
        written(
            """
            select coalesce(json_agg(pet_json(id, name, category_id, status) order by id),
                            '[]')::text as pets,
                   count(*) as count,
                   max(id) as last_id
              from (select id, name, category_id, status
                      from pets
                     where status = {status}
                       and id > %(after)s
                     order by id
                     limit {limit}) page
            """,
            status=str(status),
            limit=int(limit),
        ),
        {"after": after},
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
