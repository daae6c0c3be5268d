"""SQL over the pets table: one function per statement, connection first, rows as dicts.

PostgreSQL writes each Pet's JSON itself, with the SQL function pet_json (sql/0004_pet_json.sql:
an unstated status is left out), in the shape of schemas.PetSchema: the service sends those
bytes as they come, with no Python object per pet on the way.
"""

from __future__ import annotations

from typing import Any

from petstore.db import Connection


def list_pets(conn: Connection, *, after: int, limit: int) -> dict[str, Any]:
    """One keyset page over the primary key: {"pets": JSON array text, "count", "last_id"}."""
    row = conn.execute(
        """
        select coalesce(json_agg(pet_json(id, name, category_id, status) order by id),
                        '[]')::text as pets,
               count(*) as count,
               max(id) as last_id
          from (select id, name, category_id, status
                  from pets
                 where id > %(after)s
                 order by id
                 limit %(limit)s) page
        """,
        {"after": after, "limit": limit},
    ).fetchone()
    assert row is not None
    return row


def list_pets_by_status(conn: Connection, *, status: str, after: int, limit: int) -> dict[str, Any]:
    """One keyset page of one status over (status, id): {"pets", "count", "last_id"}."""
    row = conn.execute(
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
                 limit %(limit)s) page
        """,
        {"status": status, "after": after, "limit": limit},
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
