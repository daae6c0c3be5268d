"""bench's attribution of PostgreSQL's CPU: a server's backends are those its own processes hold
connections to, not every backend of the shared database."""

from __future__ import annotations

import os
import subprocess
import sys

from bench.database import pool_backends
from petstore import config, db

# A second process holding a connection of the service's name until its stdin closes.
HOLDER = """
import sys
from petstore import config, db
with db.connect(config.from_environ({"DATABASE_URL": sys.argv[1]})) as conn:
    print(conn.info.backend_pid, flush=True)
    sys.stdin.read()
"""


def test_a_servers_backends_are_those_its_own_processes_hold(
    database_url: str, conn: db.Connection
) -> None:
    with (
        db.connect(config.from_environ({"DATABASE_URL": database_url})) as mine,
        subprocess.Popen(
            [sys.executable, "-c", HOLDER, database_url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        ) as holder,
    ):
        assert holder.stdout is not None and holder.stdin is not None
        theirs = int(holder.stdout.readline())
        # This process holds two: the test's own connection (the fixture's) and `mine`.
        ours = sorted([conn.info.backend_pid, mine.info.backend_pid])
        try:
            assert sorted(pool_backends(conn, [os.getpid()]) or []) == ours
            assert pool_backends(conn, [holder.pid]) == [theirs]
            assert sorted(pool_backends(conn, [os.getpid(), holder.pid]) or []) == sorted(
                [*ours, theirs]
            )
        finally:
            holder.stdin.close()
            holder.wait(timeout=30)
