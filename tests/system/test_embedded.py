"""Tests of petstore.dev.embedded against real PostgreSQL servers in temporary directories."""

from __future__ import annotations

import os
import re
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import psycopg
import pytest

from petstore.dev import embedded
from tests.support.servers import accepts_connections, alive


@pytest.fixture
def datadir(tmp_path: Path) -> Iterator[Path]:
    """A cluster directory below parents that do not exist yet; its server is stopped after."""
    path = tmp_path / "var" / "postgres"
    yield path
    # pytest runs this even when the test failed, so no server outlives its test.
    embedded.stop(path)


def port_of(url: str) -> int:
    """The port of a libpq URL."""
    port = urlsplit(url).port
    assert port is not None
    return port


def postmaster_pid(datadir: Path) -> int:
    """The PID recorded in the first line of postmaster.pid."""
    return int((datadir / "postmaster.pid").read_text().split()[0])


def names(url: str) -> list[str]:
    """The names in table pets of the database at `url`."""
    with psycopg.connect(url) as conn:
        return [name for (name,) in conn.execute("select name from pets order by name")]


def test_data_survives_stop_and_start(datadir: Path) -> None:
    url = embedded.ensure_running(datadir)
    assert re.fullmatch(r"postgresql://postgres@127\.0\.0\.1:\d+/postgres", url)
    assert embedded.url(datadir) == url
    server = url.removesuffix("/postgres")
    assert embedded.url(datadir, "petstore_test") == f"{server}/petstore_test"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("create table pets (name text primary key)")
        conn.execute("insert into pets values ('Rex')")

    embedded.stop(datadir)
    assert not accepts_connections(port_of(url))
    assert embedded.url(datadir) == url  # known while stopped

    assert embedded.ensure_running(datadir) == url
    assert names(url) == ["Rex"]


def test_second_call_returns_the_same_server(datadir: Path) -> None:
    url = embedded.ensure_running(datadir)
    pid = postmaster_pid(datadir)
    assert embedded.ensure_running(datadir) == url
    assert postmaster_pid(datadir) == pid  # not restarted
    assert accepts_connections(port_of(url))


def test_restart_after_sigkill_leaves_a_stale_pid_file(datadir: Path) -> None:
    url = embedded.ensure_running(datadir)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("create table pets (name text primary key)")
        conn.execute("insert into pets values ('Rex')")
    pid = postmaster_pid(datadir)

    os.kill(pid, signal.SIGKILL)
    # A killed process stays a zombie until its parent (init, since pg_ctl has exited) reaps
    # it, and until then it counts as alive for pg_ctl too; wait for the real leftover state.
    deadline = time.monotonic() + 30
    while alive(pid):
        assert time.monotonic() < deadline, f"killed postmaster {pid} still exists"
        time.sleep(0.05)
    assert (datadir / "postmaster.pid").is_file()  # stale
    assert not accepts_connections(port_of(url))

    assert embedded.ensure_running(datadir) == url
    assert postmaster_pid(datadir) != pid
    assert names(url) == ["Rex"]  # committed before the kill, recovered from the WAL


def test_moves_to_a_free_port_when_its_port_is_taken(datadir: Path) -> None:
    old_url = embedded.ensure_running(datadir)
    embedded.stop(datadir)
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", port_of(old_url)))
        squatter.listen()
        new_url = embedded.ensure_running(datadir)
    assert port_of(new_url) != port_of(old_url)
    assert embedded.url(datadir) == new_url  # recorded for later starts
    with psycopg.connect(new_url) as conn:
        assert conn.execute("select 1").fetchone() == (1,)


def test_without_a_cluster_url_fails_and_stop_does_nothing(tmp_path: Path) -> None:
    with pytest.raises(embedded.EmbeddedPostgresError, match="no embedded PostgreSQL"):
        embedded.url(tmp_path / "nothing")
    embedded.stop(tmp_path / "nothing")
    embedded.stop(tmp_path)  # exists, but is no cluster


def test_start_url_and_stop(datadir: Path) -> None:
    """What make run and the tests call: start (the URL), the URL again, stop."""
    url = embedded.ensure_running(datadir)
    assert accepts_connections(port_of(url))
    assert embedded.url(datadir) == url
    embedded.stop(datadir)
    assert not accepts_connections(port_of(url))
    embedded.stop(datadir)  # stopping a stopped server does nothing
