"""`petstore usage` and `petstore audit`, and the audit trail every operator action appends."""

from __future__ import annotations

import getpass
import json
from datetime import UTC, datetime

import psycopg
import pytest
from psycopg import sql

from petstore import db, keys
from petstore.queries import audit as audit_sql
from petstore.queries import usage as usage_sql
from tests.conftest import Cli

DAY = datetime(2026, 11, 25, tzinfo=UTC)


def test_every_operator_action_is_in_the_audit_trail(cli: Cli, conn: db.Connection) -> None:
    created = cli("keys", "create", "--plan", "free", "--reason", "ticket 12")
    assert created.exit_code == 0, created.output
    key_id = int(created.stdout.split()[2])
    assert cli("keys", "rotate", str(key_id), "--grace", "1h").exit_code == 0
    assert cli("bans", "lift", str(key_id), "--reason", "false alarm").exit_code == 0
    assert cli("keys", "revoke", str(key_id), "--reason", "leaked").exit_code == 0
    # Refused actions change nothing, and leave no row.
    assert cli("keys", "revoke", str(key_id)).exit_code == 4
    assert cli("keys", "rotate", "999").exit_code == 3
    shown = cli("audit", "--format", "json")
    assert shown.exit_code == 0, shown.output
    rows = json.loads(shown.stdout)
    user = getpass.getuser()
    assert [(r["command"], r["key_id"], r["os_user"], r["reason"]) for r in rows] == [
        ("keys create", key_id, user, "ticket 12"),
        ("keys rotate", key_id, user, None),
        ("bans lift", key_id, user, "false alarm"),
        ("keys revoke", key_id, user, "leaked"),
    ]
    assert json.loads(cli("audit", "--key", "999", "--format", "json").stdout) == []
    assert json.loads(cli("audit", "--since", "2999-01-01", "--format", "json").stdout) == []
    table = cli("audit", "--key", str(key_id)).stdout.splitlines()
    assert table[0].split() == ["at", "command", "key", "user", "reason"]
    assert len(table) == 5 and table[4].endswith(f"keys revoke  {key_id}    {user}  leaked")


@pytest.mark.parametrize(
    "statement", ["update audit_log set reason = 'rewritten'", "delete from audit_log"]
)
def test_audit_rows_cannot_be_changed_even_by_their_owner(
    cli: Cli, conn: db.Connection, statement: str
) -> None:
    assert cli("keys", "create", "--plan", "free").exit_code == 0
    with pytest.raises(psycopg.errors.InsufficientPrivilege, match="append-only"):
        conn.execute(statement)
    assert conn.execute("select count(*) as n from audit_log").fetchone() == {"n": 1}


def seed(conn: db.Connection) -> tuple[int, int]:
    """A free key that used 900 of its 1000 a day, an enterprise key 10 of its 50; two days."""
    _free_key, free = keys.issue_key(conn, "free", "busy", None, None)
    _big_key, big = keys.issue_key(conn, "enterprise", "quiet", 10, 50)
    usage_sql.add_usage(
        conn,
        [
            (free["id"], DAY.replace(hour=3), 880, 10, 5, 0),
            (free["id"], DAY.replace(hour=4), 10, 0, 0, 0),
            (free["id"], DAY.replace(day=26, hour=4), 100, 0, 0, 0),
            (big["id"], DAY.replace(hour=9), 9, 0, 0, 1),
            (0, DAY.replace(hour=9), 0, 500, 0, 0),
        ],
    )
    return free["id"], big["id"]


def test_usage_per_key_and_day_with_the_share_of_the_daily_limit(
    cli: Cli, conn: db.Connection
) -> None:
    free, big = seed(conn)
    shown = cli("usage", "--since", "2026-11-25", "--until", "2026-11-26")
    assert shown.exit_code == 0, shown.output
    assert shown.stdout.splitlines() == [
        "key  plan        day         requests  2xx  4xx  429  5xx  limit/day  used %",
        f"{free}    free        2026-11-25  905       890  10   5    0    1000       90.0",
        f"{big}    enterprise  2026-11-25  10        9    0    0    1    50         20.0",
        f"{free}    free        2026-11-26  100       100  0    0    0    1000       10.0",
    ]
    top = json.loads(cli("usage", "--since", "2026-11-25", "--top", "1", "--format", "json").stdout)
    assert [(row["key_id"], row["day"], row["used_percent"]) for row in top] == [
        (free, "2026-11-25", 90.0)
    ]
    csv_text = cli("usage", "--key", str(big), "--since", "2026-11-20", "--format", "csv").stdout
    assert csv_text.splitlines() == [
        "key_id,plan,day,requests,2xx,4xx,429,5xx,per_day,used_percent",
        f"{big},enterprise,2026-11-25,10,9,0,0,1,50,20.0",
    ]
    only_free = cli("usage", "--plan", "free", "--since", "2026-11-25", "--format", "json").stdout
    assert {row["key_id"] for row in json.loads(only_free)} == {free}


@pytest.mark.parametrize(
    ("args", "status", "message"),
    [
        (("--key", "1", "--plan", "free"), 2, "give --key or --plan, not both"),
        (("--since", "yesterday"), 2, "--since 'yesterday': expected a date such as 2026-11-26"),
        (("--since", "2026-11-26", "--until", "2026-11-01"), 2, "is after --until"),
        (("--key", "x"), 2, "is not a key id"),
        (("--key", "999"), 3, "no key with id 999"),
        (("--format", "xml"), 2, "Invalid value for '--format'"),
    ],
)
def test_usage_refusals_have_the_usual_exit_statuses(
    cli: Cli, conn: db.Connection, args: tuple[str, ...], status: int, message: str
) -> None:
    refused = cli("usage", *args)
    assert refused.exit_code == status, refused.output
    assert message in refused.stderr


def test_the_documented_grants_let_the_app_role_read_and_append_only(
    cli: Cli, conn: db.Connection
) -> None:
    """docs/cli.rst's grants, for a role of this test's own: select and insert, nothing else."""
    role = f"petstore_audit_{conn.info.backend_pid}"
    assert cli("keys", "create", "--plan", "free").exit_code == 0

    def as_role(statement: str) -> sql.Composed:
        return sql.SQL(statement).format(sql.Identifier(role))

    conn.execute(as_role("create role {}"))
    try:
        conn.execute(as_role("grant select, insert on audit_log to {}"))
        conn.execute(as_role("revoke update, delete, truncate on audit_log from {}"))
        with conn.transaction():
            conn.execute(as_role("set local role {}"))
            audit_sql.insert_audit(conn, "keys create", None, "app", "as the app's role")
            assert len(audit_sql.list_audit(conn)) == 2
        for statement in (
            "update audit_log set reason = null",
            "delete from audit_log",
            "truncate audit_log",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege), conn.transaction():
                conn.execute(as_role("set local role {}"))
                conn.execute(statement)
    finally:
        conn.execute(as_role("drop owned by {}"))
        conn.execute(as_role("drop role {}"))
    assert conn.execute("select count(*) as n from audit_log").fetchone() == {"n": 2}
