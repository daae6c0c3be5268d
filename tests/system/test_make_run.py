"""`make run` (`petstore serve`) as a newcomer meets it: a second run, a taken port, the CLI beside it.

Each serve runs from the repository root, as `make run` does, with its var/ in a temporary
directory and the embedded PostgreSQL there.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from petstore import db
from petstore.dev import embedded
from tests.support.servers import LOOPBACK, ROOT, Gunicorn, free_port

PETSTORE = Path(sys.executable).parent / "petstore"
KEY_LINE = re.compile(r"^  KEY=(ps_[A-Za-z0-9_-]{43})$", re.MULTILINE)


def environ(var_dir: Path, **settings: str) -> dict[str, str]:
    """The environment of a `make run` with no DATABASE_URL, its var/ in `var_dir`."""
    base = {name: value for name, value in os.environ.items() if name != "DATABASE_URL"}
    return {**base, "PETSTORE_VAR_DIR": str(var_dir), "PYTHONUNBUFFERED": "1", **settings}


class MakeRun(Gunicorn):
    """`petstore serve`, the command of `make run`, on a free loopback port; stopped with SIGTERM."""

    name = "make run"

    def __init__(self, var_dir: Path, log_path: Path) -> None:
        super().__init__({}, log_path, start_timeout=120.0, stop_timeout=60.0)
        self.var_dir = var_dir
        self.bind = f"{LOOPBACK}:{self.port}"

    def command(self) -> list[str]:
        return [str(PETSTORE), "serve"]

    def start(self) -> None:
        self.launch(self.command(), cwd=ROOT, env=environ(self.var_dir, BIND=self.bind))

    def key(self) -> str:
        """The development key it printed."""
        match = KEY_LINE.search(self.log_path.read_text())
        assert match, self.log()
        return match[1]


def petstore(var_dir: Path, *args: str, **settings: str) -> subprocess.CompletedProcess[str]:
    """`petstore ARGS...` from the repository root beside the run of `var_dir`."""
    return subprocess.run(
        [str(PETSTORE), *args],
        cwd=ROOT,
        env=environ(var_dir, **settings),
        capture_output=True,
        text=True,
        timeout=120,
    )


def get_pets(base_url: str, key: str) -> int:
    request = urllib.request.Request(
        f"{base_url}/v1/pets", headers={"Authorization": f"Bearer {key}"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        status: int = response.status
        return status


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MakeRun]:
    """One `make run` serving on the embedded PostgreSQL under its own var/, for the module."""
    var_dir = tmp_path_factory.mktemp("checkout") / "var"
    try:
        with MakeRun(var_dir, var_dir.parent / "make-run.log") as run:
            yield run
    finally:
        embedded.stop(var_dir / "postgres")  # nothing outlives the tests, whatever happened


def test_a_second_make_run_is_refused_and_the_first_unharmed(first: MakeRun) -> None:
    key = first.key()
    database_url = (first.var_dir / "database-url").read_text().strip()

    for bind in (first.bind, f"{LOOPBACK}:{free_port()}"):
        second = petstore(first.var_dir, "serve", BIND=bind)

        assert second.returncode == 1
        assert second.stdout == ""
        assert second.stderr == (
            f"Error: `make run` is already serving from this checkout (pid {first.pid}, "
            f"http://{first.bind}); use that one, or stop it (Ctrl-C) first\n"
        )

    assert get_pets(first.url, key) == 200
    with psycopg.connect(database_url) as conn:
        live = conn.execute("select count(*) from api_keys where revoked_at is null").fetchone()
    assert live == (1,)  # the first run's key, not revoked, and no new one


def test_the_cli_beside_make_run_uses_its_database(first: MakeRun) -> None:
    database_url = (first.var_dir / "database-url").read_text().strip()

    listed = petstore(first.var_dir, "keys", "list")

    assert listed.returncode == 0, listed.stderr
    assert first.key()[:11] in listed.stdout
    assert "development key (make run)" in listed.stdout
    assert listed.stderr == (
        f"DATABASE_URL is not set: using the embedded database of `make run`, {database_url} "
        f"(from {first.var_dir / 'database-url'})\n"
    )


def test_a_taken_port_is_refused_before_anything_with_a_port_to_use(
    tmp_path: Path, database_url: str, conn: db.Connection
) -> None:
    with socket.socket() as squatter:
        squatter.bind((LOOPBACK, 0))
        squatter.listen()
        port = squatter.getsockname()[1]

        refused = petstore(
            tmp_path / "var", "serve", BIND=f"{LOOPBACK}:{port}", DATABASE_URL=database_url
        )

    assert refused.returncode == 1
    assert refused.stdout == ""
    match = re.fullmatch(
        rf"Error: 127\.0\.0\.1:{port} is in use by another program; "
        r"serve elsewhere with: BIND=127\.0\.0\.1:(\d+) make run\n",
        refused.stderr,
    )
    assert match, refused.stderr
    assert int(match[1]) > port
    assert conn.execute("select count(*) as n from api_keys").fetchone() == {"n": 0}


def test_make_run_leaves_running_a_database_it_did_not_start(tmp_path: Path) -> None:
    var_dir = tmp_path / "var"
    datadir = var_dir / "postgres"
    server_url = embedded.ensure_running(datadir)
    try:
        with MakeRun(var_dir, tmp_path / "make-run.log") as run:
            assert get_pets(run.url, run.key()) == 200
        log = run.log_path.read_text()
        assert "it was running already (not started by this run): it is left running" in log
        assert "stopping the embedded PostgreSQL" not in log
        with psycopg.connect(server_url) as conn:
            assert conn.execute("select 1").fetchone() == (1,)
    finally:
        embedded.stop(datadir)


def shown(text: str) -> str:
    """`make run`'s lines with what differs between runs and machines replaced by names."""
    text = re.sub(r"ps_[A-Za-z0-9_-]{43}", "KEY", text)
    text = re.sub(r"127\.0\.0\.1:\d+", "ADDRESS", text)
    text = re.sub(r"/\S*?/var/", "VAR/", text)
    return re.sub(r"cd /\S+ &&", "cd CHECKOUT &&", text)


def test_the_readme_shows_what_make_run_prints(first: MakeRun) -> None:
    """README.rst's `make run` lines are the ones it prints, up to the API docs line."""
    readme = (ROOT / "README.rst").read_text(encoding="utf-8")
    block = readme[readme.index("    $ make run\n") :].split("\n\n", 1)[0].splitlines()
    # `make` echoes its command line; petstore serve is run here without make.
    documented = [line.removeprefix("    ") for line in block[1:] if "exec " not in line]
    # As root, the embedded PostgreSQL says first which system user and directories it set up.
    printed = [
        line
        for line in first.log_path.read_text(encoding="utf-8").splitlines()
        if not line.startswith("created system user") and "o+x" not in line
    ]
    assert documented[-1].startswith("API docs: ")
    assert [shown(line) for line in printed[: len(documented)]] == [
        shown(line) for line in documented
    ]
