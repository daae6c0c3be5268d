"""Bad settings as the programs meet them: one line naming the setting, nothing else first, exit non-zero.

`gunicorn -c deploy/gunicorn.conf.py wsgi:app` (the deployment), bare `gunicorn wsgi:app`, and
`make run`; and an unreachable database: one clear error line while the service still starts.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import psycopg
import pytest
from psycopg.rows import dict_row

from petstore import migrations
from tests.support.databases import empty_database
from tests.support.servers import LOOPBACK, ROOT, Gunicorn, free_port

BIN = Path(sys.executable).parent
GOOD_URL = "postgresql://postgres@127.0.0.1:1/petstore"  # a valid URL; these never connect


def run(command: list[str], **settings: str) -> subprocess.CompletedProcess[str]:
    """`command` from the repository root with these settings (and no DATABASE_URL unless given)."""
    base = {name: value for name, value in os.environ.items() if name != "DATABASE_URL"}
    environ = {**base, "BIND": f"{LOOPBACK}:{free_port()}", **settings}
    return subprocess.run(
        command, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=120
    )


DEPLOYED = [str(BIN / "gunicorn"), "-c", "deploy/gunicorn.conf.py", "wsgi:app"]

CASES = [
    pytest.param(
        {"DATABASE_URL": GOOD_URL, "RATELIMIT_STORAGE_URI": "foo://x"},
        "RATELIMIT_STORAGE_URI='foo://x' is not valid: expected memory:// or redis://host:port/db",
        id="storage-scheme",
    ),
    pytest.param(
        {"DATABASE_URL": GOOD_URL, "PETSTORE_LOG_LEVEL": "chatty"},
        "PETSTORE_LOG_LEVEL='chatty' is not valid: expected one of DEBUG, INFO, WARNING, ERROR, "
        "CRITICAL",
        id="log-level",
    ),
    pytest.param(
        {},
        "DATABASE_URL is not set: expected the libpq URL of the PostgreSQL database",
        id="no-database-url",
    ),
    pytest.param(
        {"DATABASE_URL": GOOD_URL, "PETSTORE_THREADS": "many"},
        "PETSTORE_THREADS='many' is not valid: expected a whole number of at least 1",
        id="threads",
    ),
    pytest.param(
        {"DATABASE_URL": GOOD_URL, "OTEL_TRACES_EXPORTER": "jaeger"},
        "OTEL_TRACES_EXPORTER='jaeger' is not valid: expected otlp, console or none",
        id="traces-exporter",
    ),
]


@pytest.mark.parametrize(("settings", "start"), CASES)
def test_deployed_gunicorn_says_one_line_and_exits(
    settings: dict[str, str], start: str, tmp_path: Path
) -> None:
    # The metrics directory is made before the settings are checked: a refusal removes it too.
    done = run(DEPLOYED, TMPDIR=str(tmp_path), **settings)

    assert done.returncode == 2  # the operator's input, as a refused command line
    assert done.stdout == ""
    assert done.stderr.startswith(f"petstore: {start}")
    assert done.stderr.count("\n") == 1, done.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("settings", "start"), CASES[:2])
def test_make_run_says_one_line_before_any_key(
    settings: dict[str, str], start: str, tmp_path: Path
) -> None:
    done = run([str(BIN / "petstore"), "serve"], PETSTORE_VAR_DIR=str(tmp_path / "var"), **settings)

    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.startswith(f"Error: {start}")
    assert done.stderr.count("\n") == 1, done.stderr
    assert not (tmp_path / "var").exists()  # nothing touched, no lock taken


def test_bare_gunicorn_without_database_url_says_one_line_no_traceback() -> None:
    done = run(
        [
            str(BIN / "gunicorn"),
            "--bind",
            f"{LOOPBACK}:{free_port()}",
            "--no-control-socket",
            "wsgi:app",
        ]
    )

    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert "Traceback" not in output
    ours = [line for line in output.splitlines() if line.startswith("petstore: ")]
    assert ours == [
        "petstore: DATABASE_URL is not set: expected the libpq URL of the PostgreSQL database, "
        "such as postgresql://user:password@host:5432/dbname "
        "(or use `make run`, which starts an embedded one)"
    ]
    assert "App failed to load" in output  # gunicorn stopped rather than booting workers forever


def test_unreachable_database_is_one_clear_line_and_the_service_starts(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    environ = {"DATABASE_URL": f"postgresql://postgres@127.0.0.1:{port}/petstore"}
    with Gunicorn(environ, tmp_path / "gunicorn.log", workers=1) as server:
        request = urllib.request.Request(
            f"{server.url}/v1/pets", headers={"Authorization": "Bearer ps_" + "x" * 43}
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 503
        log = server.log_path.read_text()

    lines = [line for line in log.splitlines() if "does not answer" in line]
    assert len(lines) == 1, log
    assert '"level": "error"' in lines[0]
    assert "PostgreSQL at DATABASE_URL does not answer (connection failed: " in lines[0]
    assert f"port {port} failed" in lines[0]
    assert "serving 503 until it does" in lines[0]


def test_code_newer_than_the_schema_refuses_to_start_before_binding(database_url: str) -> None:
    """The database lacks the newest migration: one line naming it and the command, exit 1."""
    newest = migrations.migrations()[-1].name
    with empty_database(database_url, "_behind") as url:
        with psycopg.connect(url, autocommit=True, row_factory=dict_row) as conn:
            migrations.upgrade(conn)
            conn.execute("delete from schema_migrations where name = %s", [newest])
        port = free_port()

        done = run(DEPLOYED, DATABASE_URL=url, BIND=f"{LOOPBACK}:{port}")

    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr == (
        f"petstore: the database lacks the migration {newest} that this version of the code "
        "needs: run `petstore db upgrade` first (docs/upgrading.rst)\n"
    )
    with socket.socket() as probe:
        assert probe.connect_ex((LOOPBACK, port)) != 0  # nothing was ever bound there
