"""The `petstore` command: keys create/list/revoke, and db upgrade (idempotent, safe when run twice at once)."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from click.testing import Result
from flask.testing import FlaskClient

from petstore import db, migrations
from petstore.dev.server import development_key, print_welcome
from petstore.queries import keys
from tests.conftest import Cli
from tests.support.checks import pass_key_cache_bound
from tests.support.databases import empty_database

KEY = re.compile(r"ps_[A-Za-z0-9_-]{43}")
PETSTORE = Path(sys.executable).parent / "petstore"


def created_key(result: Result) -> str:
    """The key that `keys create` printed alone on its last line of stdout."""
    assert result.exit_code == 0, result.output
    last = result.stdout.splitlines()[-1]
    assert KEY.fullmatch(last), f"the last line is not a key alone: {last!r}"
    return last


def key_row(conn: db.Connection, key: str) -> dict[str, object]:
    row = conn.execute(
        "select id, label, plan::text as plan, per_minute, per_day, revoked_at from api_keys where key_hash = %s",
        [hashlib.sha256(key.encode()).digest()],
    ).fetchone()
    assert row is not None, "no api_keys row has this key's hash"
    return row


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def key_count(conn: db.Connection) -> int:
    row = conn.execute("select count(*) as n from api_keys").fetchone()
    assert row is not None
    n: int = row["n"]
    return n


# keys create


def test_keys_create_prints_a_key_that_authenticates(
    cli: Cli, conn: db.Connection, client: FlaskClient
) -> None:
    result = cli("keys", "create", "--plan", "free", "--label", "x")

    key = created_key(result)
    assert result.stdout.count(key) == 1
    assert key_row(conn, key) == {
        "id": 1,
        "label": "x",
        "plan": "free",
        "per_minute": None,
        "per_day": None,
        "revoked_at": None,
    }
    response = client.get("/v1/pets", headers=bearer(key))
    assert response.status_code == 200
    assert response.get_json() == []


@pytest.mark.parametrize(
    ("args", "plan", "per_minute", "per_day"),
    [
        pytest.param(["--plan", "pro"], "pro", None, None, id="pro"),
        pytest.param(["--plan", "business"], "business", None, None, id="business"),
        pytest.param(
            ["--plan", "pro", "--per-minute", "10"], "pro", 10, None, id="pro-overrides-per-minute"
        ),
        pytest.param(
            ["--plan", "enterprise", "--per-minute", "5000", "--per-day", "900000"],
            "enterprise",
            5000,
            900000,
            id="enterprise-with-both-numbers",
        ),
    ],
)
def test_keys_create_stores_plan_and_numbers(
    cli: Cli,
    conn: db.Connection,
    client: FlaskClient,
    args: list[str],
    plan: str,
    per_minute: int | None,
    per_day: int | None,
) -> None:
    key = created_key(cli("keys", "create", *args))

    row = key_row(conn, key)
    assert (row["plan"], row["per_minute"], row["per_day"]) == (plan, per_minute, per_day)
    assert client.get("/v1/pets", headers=bearer(key)).status_code == 200


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["--plan", "enterprise"], id="enterprise-without-numbers"),
        pytest.param(
            ["--plan", "enterprise", "--per-minute", "100"], id="enterprise-without-per-day"
        ),
        pytest.param(
            ["--plan", "enterprise", "--per-day", "1000"], id="enterprise-without-per-minute"
        ),
        pytest.param(["--plan", "gold"], id="unknown-plan"),
        pytest.param([], id="no-plan"),
        pytest.param(["--plan", "free", "--per-minute", "0"], id="per-minute-zero"),
        pytest.param(["--plan", "free", "--per-day", "-1"], id="per-day-negative"),
        pytest.param(["--plan", "free", "--per-minute", "ten"], id="per-minute-not-a-number"),
    ],
)
def test_keys_create_usage_error_stores_nothing(
    cli: Cli, conn: db.Connection, args: list[str]
) -> None:
    result = cli("keys", "create", *args)

    assert result.exit_code == 2, result.output
    assert not KEY.search(result.output)
    assert key_count(conn) == 0


def test_keys_create_usage_error_names_the_missing_numbers(cli: Cli) -> None:
    result = cli("keys", "create", "--plan", "enterprise", "--per-minute", "100")

    assert result.exit_code == 2
    assert "--per-day" in result.stderr


# keys list


def test_keys_list_shows_prefix_and_plan_but_never_the_key(cli: Cli, conn: db.Connection) -> None:
    free = created_key(cli("keys", "create", "--plan", "free", "--label", "mobile app"))
    pro = created_key(cli("keys", "create", "--plan", "pro", "--label", "partner"))
    assert cli("keys", "revoke", str(key_row(conn, pro)["id"])).exit_code == 0

    result = cli("keys", "list")

    assert result.exit_code == 0, result.output
    prefixes = {
        row["prefix"]: row["plan"]
        for row in conn.execute("select prefix, plan::text as plan from api_keys")
    }
    lines = result.stdout.splitlines()
    assert len(lines) == 3  # a heading and the two keys
    for key, label, state in ((free, "mobile app", "live"), (pro, "partner", "revoked")):
        (prefix,) = [prefix for prefix in prefixes if key.startswith(prefix)]
        (line,) = [line for line in lines if prefix in line]
        assert prefixes[prefix] in line.split()
        assert label in line
        assert state in line.split()
        # Neither the key nor anything of it beyond the display prefix is shown.
        assert key[: len(prefix) + 1] not in result.output


def test_keys_list_on_no_keys(cli: Cli) -> None:
    result = cli("keys", "list")

    assert result.exit_code == 0
    assert len(result.stdout.splitlines()) == 1


# keys revoke


def test_keys_revoke_makes_the_key_401_and_cannot_be_repeated(
    cli: Cli, conn: db.Connection, client: FlaskClient
) -> None:
    key = created_key(cli("keys", "create", "--plan", "free"))
    key_id = key_row(conn, key)["id"]
    assert client.get("/v1/pets", headers=bearer(key)).status_code == 200

    revoked = cli("keys", "revoke", str(key_id))

    assert revoked.exit_code == 0, revoked.output
    pass_key_cache_bound(client.application)
    response = client.get("/v1/pets", headers=bearer(key))
    assert response.status_code == 401
    assert response.get_json()["code"] == "unauthorized"
    revoked_at = key_row(conn, key)["revoked_at"]
    assert revoked_at is not None

    again = cli("keys", "revoke", str(key_id))

    assert again.exit_code == 4  # nothing to do
    assert again.stderr == f"Error: key {key_id} is revoked already: nothing to do\n"
    assert key_row(conn, key)["revoked_at"] == revoked_at


def test_keys_revoke_leaves_other_keys_alone(
    cli: Cli, conn: db.Connection, client: FlaskClient
) -> None:
    kept = created_key(cli("keys", "create", "--plan", "free"))
    gone = created_key(cli("keys", "create", "--plan", "free"))

    assert cli("keys", "revoke", str(key_row(conn, gone)["id"])).exit_code == 0

    assert client.get("/v1/pets", headers=bearer(kept)).status_code == 200
    assert key_row(conn, kept)["revoked_at"] is None


@pytest.mark.parametrize(
    ("key_id", "exit_code"),
    [
        pytest.param("999", 3, id="unknown-id"),
        pytest.param("abc", 2, id="not-a-number"),
        pytest.param("0", 2, id="zero"),
        pytest.param(str(2**63), 2, id="beyond-bigint"),
    ],
)
def test_keys_revoke_of_no_such_key_fails(cli: Cli, key_id: str, exit_code: int) -> None:
    result = cli("keys", "revoke", key_id)

    assert result.exit_code == exit_code, result.output


@pytest.mark.parametrize(
    "command",
    [["keys", "revoke"], ["keys", "rotate"], ["bans", "lift"]],
    ids=lambda command: " ".join(command),
)
@pytest.mark.parametrize(
    ("key_id", "exit_code", "words"),
    [
        pytest.param("abc", 2, "is not a key id", id="usage-error"),
        pytest.param("0", 2, "is not a key id", id="zero"),
        pytest.param("99", 3, "no ", id="no-such-key"),
    ],
)
def test_commands_on_a_key_share_their_exit_statuses(
    cli: Cli, command: list[str], key_id: str, exit_code: int, words: str
) -> None:
    """One status per kind of outcome, whichever command: usage error 2, no such key 3."""
    result = cli(*command, key_id)

    assert result.exit_code == exit_code, result.output
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert words in result.stderr


# configuration errors


def test_without_database_url_the_cli_says_so(cli: Cli) -> None:
    result = cli("keys", "list", env={"DATABASE_URL": None})

    assert result.exit_code == 1
    assert "DATABASE_URL" in result.stderr
    assert "Traceback" not in result.output


def test_beside_make_run_the_cli_uses_the_recorded_database_and_says_so(
    cli: Cli, database_url: str, tmp_path: Path
) -> None:
    # What `make run` writes under var/ when it serves the embedded PostgreSQL.
    (tmp_path / "database-url").write_text(database_url + "\n")
    created_key(cli("keys", "create", "--plan", "pro", "--label", "beside"))

    result = cli("keys", "list", env={"DATABASE_URL": None})

    assert result.exit_code == 0, result.output
    assert "beside" in result.stdout
    assert result.stderr == (
        f"DATABASE_URL is not set: using the embedded database of `make run`, {database_url} "
        f"(from {tmp_path / 'database-url'})\n"
    )


def test_with_database_url_set_the_recorded_one_is_ignored(cli: Cli, tmp_path: Path) -> None:
    (tmp_path / "database-url").write_text("postgresql://postgres@127.0.0.1:1/none\n")

    result = cli("keys", "list")

    assert result.exit_code == 0, result.output
    assert result.stderr == ""


def test_recorded_database_not_running_says_to_start_make_run(cli: Cli, tmp_path: Path) -> None:
    (tmp_path / "database-url").write_text("postgresql://postgres@127.0.0.1:1/petstore\n")

    result = cli("keys", "list", env={"DATABASE_URL": None})

    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 2  # which database, then why it failed
    assert lines[1].startswith("Error: cannot connect to PostgreSQL: ")
    assert lines[1].endswith("while `make run` serves: start it, or set DATABASE_URL")


def test_unreachable_database_is_a_clear_error(cli: Cli) -> None:
    result = cli("db", "upgrade", env={"DATABASE_URL": "postgresql://postgres@127.0.0.1:1/none"})

    assert result.exit_code == 1
    assert "cannot connect" in result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("module", "dev_modules"),
    [
        *[(f"petstore.cli.{group}", []) for group in ("db", "keys", "bans", "usage", "serve")],
        ("petstore.cli", []),
        # The check itself: what `petstore serve` imports when it runs.
        ("petstore.dev.server", ["petstore.dev", "petstore.dev.server"]),
    ],
)
def test_no_operator_command_imports_the_dev_server(module: str, dev_modules: list[str]) -> None:
    """petstore.dev (make run's server, the embedded PostgreSQL) is imported only when `petstore
    serve` runs: no operator command loads it."""
    listed = "sorted(name for name in sys.modules if name.split('.')[:2] == ['petstore', 'dev'])"
    code = f"import sys, {module}; print({listed})"
    imported = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout

    assert imported.strip() == repr(dev_modules)


# db upgrade


def applied_migrations(conn: db.Connection) -> list[str]:
    return [row["name"] for row in conn.execute("select name from schema_migrations order by name")]


def test_db_upgrade_is_idempotent(cli: Cli, conn: db.Connection) -> None:
    before = applied_migrations(conn)

    first = cli("db", "upgrade")
    second = cli("db", "upgrade")

    for result in (first, second):
        assert result.exit_code == 0, result.output
        assert result.stdout.strip() == "schema is up to date"
    assert applied_migrations(conn) == before == [m.name for m in migrations.migrations()]


@pytest.fixture
def migrate_database_url(database_url: str) -> Iterator[str]:
    """A new empty database, for `petstore db upgrade` to start from nothing."""
    with empty_database(database_url, "_migrate") as url:
        yield url


def waiting_for_lock(conn: psycopg.Connection[tuple[int]]) -> int:
    """How many sessions of this database wait for an advisory lock."""
    row = conn.execute(
        """
        select count(*)
          from pg_locks
         where locktype = 'advisory'
           and not granted
           and database = (select oid from pg_database where datname = current_database())
        """
    ).fetchone()
    assert row is not None
    return row[0]


def start_upgrade(url: str, **environ: str) -> subprocess.Popen[str]:
    """`petstore db upgrade` as its own process, as two deploy scripts would run it."""
    return subprocess.Popen(
        [str(PETSTORE), "db", "upgrade"],
        env={**os.environ, "DATABASE_URL": url, **environ},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_until_waiting(
    conn: psycopg.Connection[tuple[int]], processes: list[subprocess.Popen[str]]
) -> None:
    """Poll until every process waits for the migration lock (fail if one exits first)."""
    deadline = time.monotonic() + 30
    while waiting_for_lock(conn) < len(processes):
        for process in processes:
            if process.poll() is not None:
                out, err = process.communicate()
                pytest.fail(f"`petstore db upgrade` exited {process.returncode} early:\n{out}{err}")
        assert time.monotonic() < deadline, "the upgrades never reached the migration lock"
        time.sleep(0.02)  # a poll interval, not a wait for something to happen


def test_two_concurrent_upgrades_of_an_empty_database(migrate_database_url: str) -> None:
    with psycopg.connect(migrate_database_url, autocommit=True) as holder:
        # Hold the migration lock so that both processes are surely at the start line together.
        holder.execute("select pg_advisory_lock(%s)", [migrations.MIGRATION_LOCK])
        processes = [start_upgrade(migrate_database_url) for _ in range(2)]
        try:
            wait_until_waiting(holder, processes)
        finally:
            holder.execute("select pg_advisory_unlock(%s)", [migrations.MIGRATION_LOCK])
        outputs = [process.communicate(timeout=60) for process in processes]

        for process, (out, err) in zip(processes, outputs, strict=True):
            assert process.returncode == 0, out + err
        names = [m.name for m in migrations.migrations()]
        stdouts = sorted(out.strip() for out, _err in outputs)
        assert stdouts == sorted([f"applied: {', '.join(names)}", "schema is up to date"])
        rows = holder.execute(
            "select name, count(*) from schema_migrations group by name order by name"
        ).fetchall()
        assert rows == [(name, 1) for name in names]
        tables = holder.execute("select to_regclass('pets'), to_regclass('api_keys')").fetchone()
        assert tables == ("pets", "api_keys")


def test_an_upgrade_waits_for_a_slow_one_beyond_the_statement_timeout(
    migrate_database_url: str,
) -> None:
    with psycopg.connect(migrate_database_url, autocommit=True) as holder:
        # Another upgrade holds the lock longer than the service's statement timeout (shrunk to 50 ms here):
        # a migration may take that long, and the waiting upgrade must not fail because of it.
        holder.execute("select pg_advisory_lock(%s)", [migrations.MIGRATION_LOCK])
        process = start_upgrade(migrate_database_url, PETSTORE_DB_STATEMENT_TIMEOUT_MS="50")
        try:
            wait_until_waiting(holder, [process])
            try:
                process.wait(timeout=1)  # twenty statement timeouts
            except subprocess.TimeoutExpired:
                pass  # still waiting for the lock, as it should
            else:
                out, err = process.communicate()
                pytest.fail(f"the waiting upgrade exited {process.returncode}: {err[-300:]}")
        finally:
            holder.execute("select pg_advisory_unlock(%s)", [migrations.MIGRATION_LOCK])
        out, err = process.communicate(timeout=60)

    assert process.returncode == 0, out + err
    assert out.startswith("applied: ")


# make run's development key


def test_make_run_keeps_its_development_key_across_restarts(
    conn: db.Connection, client: FlaskClient, tmp_path: Path
) -> None:
    """The key pasted in another terminal keeps working after a restart; it sits in a 0600 file."""
    path = tmp_path / "development-key"
    first, first_id, kept = development_key(conn, path)
    assert not kept
    assert path.read_text(encoding="utf-8") == first + "\n"
    assert path.stat().st_mode & 0o777 == 0o600

    again, again_id, kept = development_key(conn, path)

    assert (again, again_id, kept) == (first, first_id, True)
    response = client.get("/v1/pets", headers={"Authorization": f"Bearer {first}"})
    assert response.status_code == 200


def test_a_revoked_development_key_is_replaced(
    conn: db.Connection, client: FlaskClient, tmp_path: Path
) -> None:
    """A kept key that no longer works is replaced, and the file holds the new one (still 0600)."""
    path = tmp_path / "development-key"
    old, old_id, _ = development_key(conn, path)
    assert keys.revoke_key(conn, old_id)

    new, new_id, kept = development_key(conn, path)

    assert not kept and new != old and new_id != old_id
    assert path.read_text(encoding="utf-8") == new + "\n"
    assert path.stat().st_mode & 0o777 == 0o600
    assert client.get("/v1/pets", headers={"Authorization": f"Bearer {new}"}).status_code == 200


@pytest.mark.parametrize(
    ("given", "cli_line"),
    [
        # DATABASE_URL set: the CLI line names it (else it would read a stale var/database-url).
        (
            True,
            "  cd {cwd} && DATABASE_URL='postgresql://petstore:****@127.0.0.1:5432/petstore' "
            ".venv/bin/petstore keys list",
        ),
        # The embedded database: the CLI finds it in var/database-url.
        (False, "  cd {cwd} && .venv/bin/petstore keys list"),
    ],
)
def test_make_runs_lines_show_no_password_and_the_cli_line_its_database(
    given: bool, cli_line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    print_welcome(
        "postgresql://petstore:s3cret@127.0.0.1:5432/petstore",
        given,
        "127.0.0.1:8000",
        "ps_x",
        1,
        False,
        Path("var/development-key"),
    )

    printed = capsys.readouterr().out
    assert printed.splitlines()[0] == "database: postgresql://petstore:****@127.0.0.1:5432/petstore"
    assert cli_line.format(cwd=Path.cwd()) in printed.splitlines()
    assert "s3cret" not in printed
