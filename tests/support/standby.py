"""A PostgreSQL 15 primary and its streaming standby (Debian's binaries) on loopback ports of their own.

The standby is made by pg_basebackup from the primary and may replay with a delay
(recovery_min_apply_delay), as a standby that falls behind does. Both run in the foreground as
the account petstore.dev.embedded uses under root; stopping one is a fast shutdown (SIGINT).
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import psycopg
import pytest
from psycopg import conninfo

from tests.support.patroni import PG_BIN, as_account, give_to_account
from tests.support.programs import install_command
from tests.support.servers import LOOPBACK, ServerFailed, ServerProcess

# Settings of both servers: loopback only, no Unix socket, small and quick.
SERVER_SETTINGS = {
    "listen_addresses": LOOPBACK,
    "unix_socket_directories": "",
    "shared_buffers": "16MB",
    "max_connections": "40",
    "fsync": "off",
    "wal_level": "replica",
    "max_wal_senders": "4",
    "hot_standby": "on",
}


class PostgresServer(ServerProcess):
    """`postgres -D datadir` on a free loopback port; start() again restarts it on the same port."""

    name = "postgres"
    ready = "accept connections"
    stop_signal = signal.SIGINT  # fast shutdown: every connection is cut
    log_mode = "ab"

    def __init__(self, datadir: Path, settings: dict[str, str] | None = None) -> None:
        super().__init__(datadir.with_suffix(".log"), start_timeout=60.0, stop_timeout=30.0)
        self.datadir = datadir
        self.settings = {**SERVER_SETTINGS, **(settings or {})}

    def url(self, dbname: str = "postgres") -> str:
        """The libpq URL of database `dbname` on this server."""
        return conninfo.make_conninfo(
            "", host=LOOPBACK, port=str(self.port), dbname=dbname, user="postgres"
        )

    def start(self) -> None:
        """Run the server and wait until it accepts connections."""
        options = [f"--{name.replace('_', '-')}={value}" for name, value in self.settings.items()]
        self.launch(
            as_account(
                [str(PG_BIN / "postgres"), "-D", str(self.datadir), "-p", str(self.port), *options]
            )
        )

    def promote(self) -> None:
        """End a standby's recovery (pg_ctl promote) and wait until it takes writes. No session is
        open on it meanwhile: a query (`select pg_promote()` too) that holds a snapshot while the
        last WAL is replayed can be cancelled by a conflict with recovery."""
        run_as_account(
            [str(PG_BIN / "pg_ctl"), "promote", "-w", "-t", "60", "-D", str(self.datadir)]
        )

    def answers(self) -> bool:
        """Whether it accepts a connection (and, a standby, read-only queries) right now."""
        try:
            with psycopg.connect(self.url(), connect_timeout=1, autocommit=True) as conn:
                conn.execute("select 1")
        except psycopg.Error:
            return False
        return True


def run_as_account(command: list[str]) -> None:
    """Run an initdb or pg_basebackup as the server's account; raise with its output on failure."""
    done = subprocess.run(
        as_account(command), capture_output=True, text=True, timeout=120, cwd="/", check=False
    )
    if done.returncode != 0:
        raise ServerFailed(f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")


def make_primary(workdir: Path) -> PostgresServer:
    """A new cluster (trust authentication, replication allowed on loopback), not started;
    skips the calling test when Debian's PostgreSQL 15 is not installed."""
    if not (PG_BIN / "pg_basebackup").exists():
        pytest.skip(
            f"{PG_BIN} has no pg_basebackup (postgresql-15): install it as root with "
            f"`{install_command('patroni')}`"
        )
    datadir = workdir / "primary"
    give_to_account(workdir)
    give_to_account(datadir)
    run_as_account(
        [str(PG_BIN / "initdb"), "-D", str(datadir), "-U", "postgres", "--auth=trust", "-N"]
    )
    return PostgresServer(datadir)


def make_standby(workdir: Path, primary: PostgresServer, apply_delay: str) -> PostgresServer:
    """A streaming standby of the running `primary`, replaying `apply_delay` behind, not started."""
    datadir = workdir / "standby"
    run_as_account(
        [
            str(PG_BIN / "pg_basebackup"),
            "-h",
            LOOPBACK,
            "-p",
            str(primary.port),
            "-U",
            "postgres",
            "-D",
            str(datadir),
            "-R",  # standby.signal and primary_conninfo
            "-X",
            "stream",
            "-c",
            "fast",
        ]
    )
    return PostgresServer(datadir, {"recovery_min_apply_delay": apply_delay})
