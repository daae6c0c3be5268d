"""SQL over the pets table: one function per statement, connection first, rows as dicts.

PostgreSQL writes each Pet's JSON itself, with the SQL function pet_json (sql/0004_pet_json.sql:
an unstated status is left out), in the shape of schemas.PetSchema: the service sends those
bytes as they come, with no Python object per pet on the way.

A page's LIMIT and status filter are written into its statement (page_statement), not sent as
parameters: PostgreSQL plans a prepared statement once for all its parameters' values (its
generic plan) once it finds that plan no dearer than the ones made for the values. It costs
`limit $n` as a tenth of the table, a cost that grows with the table, so it planned the first
page anew at every call and the filtered page past about 100,000 pets; and it plans `status =
$1` for no status in particular. With the values in the text, each page size and status has a
statement of its own, whose one parameter, the keyset's `after`, leaves its plan as it is:
planned once per connection at any size (docs/performance.rst).
"""

from __future__ import annotations

import functools
from typing import Any

from psycopg import sql

from petstore import tracing
from petstore.db import Connection


@functools.lru_cache(maxsize=512)
def page_statement(limit: int, status: str | None) -> str:
    """One keyset page's statement with its LIMIT and status (when one is asked) written in, made
    once per page size and status; its one parameter is `after`."""
    only = sql.SQL("status = {} and").format(sql.Literal(status)) if status else sql.SQL("")
    return (
        sql.SQL(
            """
            select coalesce(json_agg(pet_json(id, name, category_id, status) order by id),
                            '[]')::text as pets,
                   count(*) as count,
                   max(id) as last_id
              from (select id, name, category_id, status
                      from pets
                     where {only} id > %(after)s
                     order by id
                     limit {limit}) page
            """
        )
        .format(only=only, limit=sql.Literal(limit))
        .as_string(None)
    )


@tracing.statement
def list_pets(conn: Connection, *, after: int, limit: int) -> dict[str, Any]:
    """One keyset page over the primary key: {"pets": JSON array text, "count", "last_id"}."""
    row = conn.execute(page_statement(int(limit), None), {"after": after}).fetchone()
    assert row is not None
    return row


@tracing.statement
def list_pets_by_status(conn: Connection, *, status: str, after: int, limit: int) -> dict[str, Any]:
    """One keyset page of one status: {"pets", "count", "last_id"}."""
    row = conn.execute(page_statement(int(limit), str(status)), {"after": after}).fetchone()
    assert row is not None
    return row


@tracing.statement
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


@tracing.statement
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
