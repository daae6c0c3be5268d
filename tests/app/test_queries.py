"""The query functions (petstore/queries) leave the transaction to their caller.

Each runs on a connection that is not in autocommit, inside a transaction that the test then
rolls back: the transaction must still be open after every call (a stray commit() ends it) and
nothing the functions wrote may remain. Connections in the service are in autocommit, so a
commit inside a query function would pass every other test while breaking the callers that
make several statements atomic (a ban, an Idempotency-Key claim with its pet).
"""

from __future__ import annotations

import hashlib
import inspect
import pkgutil
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

import psycopg
import pytest
from psycopg.pq import TransactionStatus
from psycopg.rows import dict_row

from petstore import db, queries, tracing
from petstore.queries import audit as audit_sql
from petstore.queries import bans as ban_sql
from petstore.queries import idempotency as idempotency_sql
from petstore.queries import keys as key_sql
from petstore.queries import pets as pet_sql
from petstore.queries import usage as usage_sql

MODULES = {
    "pet_sql": pet_sql,
    "key_sql": key_sql,
    "ban_sql": ban_sql,
    "idempotency_sql": idempotency_sql,
    "usage_sql": usage_sql,
    "audit_sql": audit_sql,
}


@pytest.fixture
def tx(conn: db.Connection, database_url: str) -> Iterator[db.Connection]:
    """A second connection, not in autocommit: its first statement opens a transaction.

    Depends on `conn`, which empties the tables first; rolled back at the end whatever happens.
    """
    with psycopg.connect(database_url, row_factory=dict_row, autocommit=False) as tx:
        try:
            yield tx
        finally:
            tx.rollback()


def still_open(tx: db.Connection, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a query function; the transaction it ran in must still be open (nothing committed)."""
    result = function(*args, **kwargs)
    status = tx.info.transaction_status
    assert status == TransactionStatus.INTRANS, (
        f"{function.__name__} ended the transaction: {status!r}"
    )
    return result


def new_key(tx: db.Connection, label: str = "queries") -> dict[str, Any]:
    """A key row inside the transaction (bans and idempotency records belong to a key)."""
    row: dict[str, Any] = still_open(
        tx,
        key_sql.insert_key,
        tx,
        key_hash=hashlib.sha256(label.encode()).digest(),
        prefix="ps_test",
        label=label,
        plan="free",
        per_minute=None,
        per_day=None,
    )
    return row


def test_pet_queries_commit_nothing(tx: db.Connection, conn: db.Connection) -> None:
    added = still_open(tx, pet_sql.insert_pet, tx, name="Rex", category_id=1, status="available")
    still_open(tx, pet_sql.insert_pet, tx, name="Tom", category_id=2, status=None)
    assert '"Rex"' in still_open(tx, pet_sql.find_pet, tx, added["id"])
    assert still_open(tx, pet_sql.list_pets, tx, after=0, limit=10)["count"] == 2
    page = still_open(tx, pet_sql.list_pets_by_status, tx, status="available", after=0, limit=10)
    assert page["count"] == 1 and page["last_id"] == added["id"]

    tx.rollback()
    assert conn.execute("select count(*) as n from pets").fetchone() == {"n": 0}


def test_key_queries_commit_nothing(tx: db.Connection, conn: db.Connection) -> None:
    key = new_key(tx)
    other = new_key(tx, "other")
    digest = hashlib.sha256(b"queries").digest()
    assert still_open(tx, key_sql.find_key_by_hash, tx, digest)["id"] == key["id"]
    assert [row["id"] for row in still_open(tx, key_sql.list_keys, tx)] == [key["id"], other["id"]]
    new_digest = hashlib.sha256(b"rotated").digest()
    rotated = still_open(
        tx,
        key_sql.rotate_key,
        tx,
        key["id"],
        key_hash=new_digest,
        prefix="ps_new",
        grace_seconds=60,
    )
    assert rotated is not None and rotated["id"] == key["id"]
    assert still_open(tx, key_sql.find_key_by_hash, tx, new_digest)["id"] == key["id"]
    assert still_open(tx, key_sql.revoke_key, tx, key["id"]) is True
    assert still_open(tx, key_sql.find_key, tx, key["id"])["revoked_at"] is not None
    assert still_open(tx, key_sql.find_key, tx, key["id"] + 1000) is None
    assert still_open(tx, key_sql.revoke_keys_labelled, tx, "other") == 1

    tx.rollback()
    assert key_sql.list_keys(conn) == []


def test_ban_queries_commit_nothing(tx: db.Connection, conn: db.Connection) -> None:
    key = new_key(tx)
    ban = still_open(
        tx,
        ban_sql.insert_ban,
        tx,
        key_id=key["id"],
        base_seconds=60,
        strikes=10,
        escalation=2,
        max_seconds=86_400,
        repeat_seconds=86_400,
    )
    assert ban is not None and ban["seconds"] == 60
    assert [row["id"] for row in still_open(tx, ban_sql.list_bans, tx)] == [ban["id"]]
    assert still_open(tx, ban_sql.lift_bans, tx, key["id"]) == 1
    first = still_open(tx, ban_sql.forgive_strikes, tx, key["id"])
    assert first is not None and first["before"] is None and first["after"] is not None
    again = still_open(tx, ban_sql.forgive_strikes, tx, key["id"])
    assert again is not None and again["before"] == first["after"]
    assert still_open(tx, ban_sql.forgive_strikes, tx, key["id"] + 1000) is None

    tx.rollback()
    assert ban_sql.list_bans(conn) == []
    assert conn.execute("select count(*) as n from bans").fetchone() == {"n": 0}


def test_idempotency_queries_commit_nothing(tx: db.Connection, conn: db.Connection) -> None:
    key = new_key(tx)
    record = {
        "key_id": key["id"],
        "idempotency_key": "k-1",
        "fingerprint": hashlib.sha256(b"{}").digest(),
    }
    claimed = still_open(
        tx, idempotency_sql.claim, tx, **record, status=201, body="{}", location="/v1/pets/1"
    )
    assert claimed is True
    found = still_open(
        tx, idempotency_sql.find_response, tx, key_id=key["id"], idempotency_key="k-1"
    )
    assert found is not None and found["status"] == 201
    still_open(tx, idempotency_sql.rewrite_record, tx, key_id=key["id"], idempotency_key="k-1")
    rewritten = idempotency_sql.find_response(tx, key_id=key["id"], idempotency_key="k-1")
    assert rewritten == found  # written again, unchanged
    assert still_open(tx, idempotency_sql.delete_expired, tx) == 0

    tx.rollback()
    assert conn.execute("select count(*) as n from idempotency_requests").fetchone() == {"n": 0}


def test_usage_queries_commit_nothing(tx: db.Connection, conn: db.Connection) -> None:
    key = new_key(tx)
    hour = datetime(2026, 11, 25, 9, tzinfo=UTC)
    still_open(tx, usage_sql.add_usage, tx, [(key["id"], hour, 3, 1, 0, 0)])
    still_open(tx, usage_sql.add_usage, tx, [(key["id"], hour, 2, 0, 1, 1)])
    [day] = still_open(
        tx, usage_sql.usage_of_key, tx, key["id"], hour.replace(hour=0), hour.replace(day=26), "day"
    )
    assert (day["requests_2xx"], day["requests_4xx"], day["requests_429"]) == (5, 1, 1)
    [daily] = still_open(tx, usage_sql.daily_usage, tx, hour.replace(hour=0), hour.replace(day=26))
    assert daily["key_id"] == key["id"] and daily["requests_5xx"] == 1
    still_open(tx, audit_sql.insert_audit, tx, "keys create", key["id"], "ops", None)
    assert [row["command"] for row in still_open(tx, audit_sql.list_audit, tx)] == ["keys create"]
    assert still_open(tx, usage_sql.delete_usage_before, tx, hour.replace(day=26)) == 1

    tx.rollback()
    assert conn.execute("select count(*) as n from key_usage").fetchone() == {"n": 0}
    assert conn.execute("select count(*) as n from audit_log").fetchone() == {"n": 0}


def test_a_stray_commit_fails_the_check(tx: db.Connection, conn: db.Connection) -> None:
    """The check above can fail: a query function that commits is caught, and its row stays."""

    def committing_insert(tx: db.Connection) -> None:
        pet_sql.insert_pet(tx, name="Stray", category_id=1, status=None)
        tx.commit()

    with pytest.raises(AssertionError, match="committing_insert ended the transaction"):
        still_open(tx, committing_insert, tx)
    assert conn.execute("select count(*) as n from pets").fetchone() == {"n": 1}


def public_functions(module: ModuleType) -> list[str]:
    """The functions a query module defines (not the ones it imports)."""
    return [
        name
        for name, value in inspect.getmembers(module, inspect.isfunction)
        if value.__module__ == module.__name__ and not name.startswith("_")
    ]


def test_every_query_module_is_in_the_table() -> None:
    """A new module of petstore/queries needs its alias in MODULES, so that its functions are
    checked below."""
    shipped = {info.name for info in pkgutil.iter_modules(queries.__path__)}
    assert shipped == {module.__name__.rpartition(".")[2] for module in MODULES.values()}


def test_every_query_function_is_called_here() -> None:
    """A new query function needs a call in this file, through still_open."""
    source = Path(__file__).read_text(encoding="utf-8")
    missing = [
        f"{module.__name__}.{name}"
        for alias, module in MODULES.items()
        for name in public_functions(module)
        if f"{alias}.{name}," not in source
    ]
    assert not missing


def test_every_query_function_is_traced() -> None:
    """A new query function carries @tracing.statement: its statement is a span of the trace."""
    traced = tracing.statement(lambda: None).__code__
    untraced = [
        f"{module.__name__}.{name}"
        for module in MODULES.values()
        for name in public_functions(module)
        if getattr(module, name).__code__ is not traced
    ]
    assert not untraced


def seed_pets(tx: db.Connection, count: int) -> None:
    """`count` pets, half of them available, a quarter each pending and sold; then analyzed."""
    tx.execute(
        """
        insert into pets (name, category_id, status)
        select 'pet ' || n, n %% 100 + 1,
               (array['available', 'pending', 'available', 'sold'])[n %% 4 + 1]::pet_status
          from generate_series(1, %(count)s) n
        """,
        {"count": count},
    )
    tx.execute("analyze pets")


def test_pages_keep_one_generic_plan_however_large_the_table(tx: db.Connection) -> None:
    """A page's statement is planned once per connection, not at every call, at any table size,
    and only the keyset's `after` is a parameter: nothing a plan made for any value could get wrong.

    With `limit $n` PostgreSQL costs a generic plan for a tenth of the table, so past some size
    it planned every page anew; at 100,000 pets the first page and the filtered page both did.
    """
    seed_pets(tx, 100_000)
    for _ in range(12):  # prepared from the 5th call; PostgreSQL plans 5 custom plans first
        pet_sql.list_pets(tx, after=0, limit=20)
        pet_sql.list_pets_by_status(tx, status="available", after=0, limit=100)
    plans = tx.execute(
        """
        select statement, generic_plans, custom_plans, cardinality(parameter_types) as parameters
          from pg_prepared_statements
         where statement like '%%from pets%%order by id%%'
        """
    ).fetchall()
    assert len(plans) == 2, plans
    for plan in plans:
        assert plan["generic_plans"] >= 2, plan
        assert plan["parameters"] == 1, plan


@pytest.mark.parametrize("status", ["available", "pending", "sold"])
def test_a_filtered_page_keeps_its_index_when_the_estimate_is_far_too_low(
    tx: db.Connection, status: str
) -> None:
    """After creates, their deletion and a plain VACUUM, PostgreSQL's estimate of the table can
    fall far below the truth (make bench's churn: 364 for 10,006 pets). The filtered page must
    keep its ordered index read whatever the estimate, not turn to a sequential scan and a sort
    of the whole table, which the two-column (status, id) index lost to at a tenth (sql/0008)."""
    seed_pets(tx, 10_000)
    for share in (1.0, 0.25, 0.1, 0.03):
        # What a drifted VACUUM leaves in pg_class, in this transaction only (rolled back).
        tx.execute(
            "update pg_class set reltuples = %s where oid = 'pets'::regclass", [10000 * share]
        )
        statement = pet_sql.page_statement(100, status)
        plan = "\n".join(
            str(row["QUERY PLAN"])
            for row in tx.execute("explain " + statement, {"after": 0}).fetchall()
        )
        assert f"pets_{status}_id_idx" in plan, (share, plan)
        assert "Seq Scan" not in plan and "Sort" not in plan, (share, plan)
