"""deploy/install.sh, the single-host deployment of docs/deploying.rst, run for real on loopback.

It runs with a throwaway role and database on the test's PostgreSQL server, its environment file
and gunicorn's pid file and log in a temporary directory, this virtualenv, and a free port; the
gunicorn it starts, the database and the role are removed afterwards.
"""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import conninfo, sql

from support.servers import LOOPBACK, ROOT, free_port

SCRIPT = ROOT / "deploy" / "install.sh"


@pytest.fixture
def throwaway(database_url: str) -> Iterator[tuple[str, str]]:
    """(admin URL, role and database name); both dropped afterwards."""
    admin_url = conninfo.make_conninfo(database_url, dbname="postgres")
    name = f"petstore_install_{os.getpid()}"
    yield admin_url, name
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(
            sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name))
        )
        admin.execute(sql.SQL("drop role if exists {}").format(sql.Identifier(name)))


def stop_gunicorn(pid_file: Path) -> None:
    """SIGTERM the gunicorn the script started (a session of its own), then SIGKILL what is left."""
    if not pid_file.exists():
        return
    pid = int(pid_file.read_text())
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.killpg(pid, signal.SIGKILL)


def test_install_script_serves_a_key_on_a_fresh_role_and_database(
    throwaway: tuple[str, str], tmp_path: Path
) -> None:
    admin_url, name = throwaway
    server = conninfo.conninfo_to_dict(admin_url)
    bind = f"{LOOPBACK}:{free_port()}"
    state = tmp_path / "state"
    environ = {
        **{key: value for key, value in os.environ.items() if key != "DATABASE_URL"},
        "PETSTORE_DB": name,
        "PETSTORE_DB_HOST": str(server.get("host", LOOPBACK)),
        "PETSTORE_DB_PORT": str(server.get("port", 5432)),
        "PG_ADMIN_URL": admin_url,
        "BIND": bind,
        "PETSTORE_ENV": str(tmp_path / "petstore.env"),
        "PETSTORE_STATE_DIR": str(state),
        "PETSTORE_VENV": sys.prefix,
    }
    try:
        done = subprocess.run(
            ["bash", str(SCRIPT)],
            cwd=tmp_path,  # the script finds the checkout itself
            env=environ,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        stop_gunicorn(state / "gunicorn.pid")

    assert done.returncode == 0, done.stdout + done.stderr
    key = re.search(r"^KEY=(ps_[A-Za-z0-9_-]{43})$", done.stdout, re.MULTILINE)
    assert key, done.stdout
    assert re.search(r"^HTTP/1\.1 200 OK\r?$", done.stdout, re.MULTILINE), done.stdout
    assert "X-RateLimit-Limit: 60" in done.stdout
    assert done.stdout.rstrip().endswith(f"stop it with: kill $(cat {state}/gunicorn.pid)")

    env_file = tmp_path / "petstore.env"
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    settings = dict(line.split("=", 1) for line in env_file.read_text().splitlines())
    assert settings["BIND"] == bind
    database = conninfo.conninfo_to_dict(settings["DATABASE_URL"])
    assert (database["user"], database["dbname"]) == (name, name)
    with psycopg.connect(settings["DATABASE_URL"]) as conn:  # the role owns the database
        owner = conn.execute(
            "select pg_get_userbyid(datdba) from pg_database where datname = current_database()"
        ).fetchone()
        keys = conn.execute("select label from api_keys").fetchall()
    assert owner == (name,)
    assert keys == [("first",)]
