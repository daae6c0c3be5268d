"""SQL over the pets table: one function per statement, connection first, rows as dicts."""

from __future__ import annotations

from typing import Any

from petstore.db import Connection


def list_pets(conn: Connection, *, after: int, limit: int) -> list[dict[str, Any]]:
    """Pets with id > after, by id ascending (keyset page over the primary key)."""
    return conn.execute(
        """
        select id, name, category_id, status
          from pets
         where id > %(after)s
         order by id
         limit %(limit)s
        """,
        {"after": after, "limit": limit},
    ).fetchall()


def list_pets_by_status(
    conn: Connection, *, status: str, after: int, limit: int
) -> list[dict[str, Any]]:
    """Pets of one status with id > after, by id ascending (keyset page over (status, id))."""
    return conn.execute(
        """
        select id, name, category_id, status
          from pets
         where status = %(status)s
           and id > %(after)s
         order by id
         limit %(limit)s
        """,
        {"status": status, "after": after, "limit": limit},
    ).fetchall()


def find_pet(conn: Connection, pet_id: int) -> dict[str, Any] | None:
    """The pet with this id, or None."""
    return conn.execute(
        "select id, name, category_id, status from pets where id = %(pet_id)s",
        {"pet_id": pet_id},
    ).fetchone()


def insert_pet(
    conn: Connection, *, name: str, category_id: int, status: str | None
) -> dict[str, Any]:
    """Store a new pet and return it with its id."""
    row = conn.execute(
        """
        insert into pets (name, category_id, status)
        values (%(name)s, %(category_id)s, %(status)s)
        returning id, name, category_id, status
        """,
        {"name": name, "category_id": category_id, "status": status},
    ).fetchone()
    assert row is not None
    return row
