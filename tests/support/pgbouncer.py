"""Debian's PgBouncer with the shipped deploy/pgbouncer.ini, on a loopback port of its own."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from tests.support.programs import program
from tests.support.servers import LOOPBACK, ROOT, ServerProcess, accepts_connections

PGBOUNCER_INI = ROOT / "deploy" / "pgbouncer.ini"


def replace_line(text: str, old: str, new: str) -> str:
    """`text` with its one line `old` replaced by `new`; an error if the line is not there exactly once."""
    lines = text.splitlines()
    found = [number for number, line in enumerate(lines) if line.strip() == old]
    if len(found) != 1:
        raise ValueError(f"{old!r} is in the text {len(found)} times, expected once")
    lines[found[0]] = new
    return "\n".join(lines) + "\n"


class PgBouncer(ServerProcess):
    """Debian's `pgbouncer` with the shipped deploy/pgbouncer.ini on a free loopback port, before `target_url`.

    Only the addresses (loopback and `also_listen`), the socket directory and the
    authentication (trust, as the test server's) differ from the shipped file. stop() is an
    immediate shutdown (SIGTERM), which cuts every client; start() again is a restart on the same port.
    """

    name = "pgbouncer"
    ready = "accept connections"
    log_mode = "ab"

    def __init__(
        self,
        workdir: Path,
        target_url: str,
        *,
        dbname: str = "petstore",
        also_listen: Sequence[str] = (),
        settings: Mapping[str, str] | None = None,
        start_timeout: float = 10.0,
        stop_timeout: float = 10.0,
    ) -> None:
        super().__init__(
            workdir / "pgbouncer.log", start_timeout=start_timeout, stop_timeout=stop_timeout
        )
        self.workdir = workdir
        self.target_url = target_url
        self.dbname = dbname
        self.also_listen = list(also_listen)
        # More lines of its [pgbouncer] section, the ini's last one: settings the shipped file leaves out.
        self.settings = dict(settings or {})

    def url(self, host: str = LOOPBACK) -> str:
        """The libpq URL of the pooled database, through this PgBouncer (at `host`, one it listens on).

        The user is the target URL's: PgBouncer logs in to PostgreSQL as its client's user.
        """
        from psycopg import conninfo

        user = conninfo.conninfo_to_dict(self.target_url).get("user", "postgres")
        return f"postgresql://{user}@{host}:{self.port}/{self.dbname}"

    def write_config(self) -> Path:
        """deploy/pgbouncer.ini with this test's addresses and trust authentication."""
        from psycopg import conninfo

        target = conninfo.conninfo_to_dict(self.target_url)
        text = PGBOUNCER_INI.read_text(encoding="utf-8")
        text = replace_line(
            text,
            "petstore = host=127.0.0.1 port=5432 dbname=petstore",
            f"{self.dbname} = host={target.get('host', LOOPBACK)} "
            f"port={target.get('port', 5432)} dbname={target['dbname']}",
        )
        text = replace_line(
            text,
            "listen_addr = 127.0.0.1",
            f"listen_addr = {','.join([LOOPBACK, *self.also_listen])}",
        )
        text = replace_line(text, "listen_port = 6432", f"listen_port = {self.port}")
        text = replace_line(text, "unix_socket_dir = /var/run/postgresql", "unix_socket_dir =")
        text = replace_line(text, "auth_type = scram-sha-256", "auth_type = trust")
        userlist = self.workdir / "userlist.txt"
        # trust still wants the user in the auth file: the target's (the clients connect as it).
        userlist.write_text(f'"{target.get("user", "postgres")}" ""\n', encoding="utf-8")
        text = replace_line(
            text, "auth_file = /etc/pgbouncer/userlist.txt", f"auth_file = {userlist}"
        )
        text += "".join(f"{name} = {value}\n" for name, value in self.settings.items())
        path = self.workdir / "pgbouncer.ini"
        path.write_text(text, encoding="utf-8")
        return path

    def command(self, ini: Path) -> list[str]:
        """In the foreground, logging to the log file; as postgres when run as root (it refuses root)."""
        user = ["--user", "postgres"] if os.geteuid() == 0 else []
        return [program("pgbouncer"), *user, str(ini)]

    def start(self) -> None:
        """Start pgbouncer and wait (bounded) until it accepts connections; raise with its log otherwise."""
        assert self.process is None, "pgbouncer is running already"
        self.workdir.mkdir(parents=True, exist_ok=True)
        ini = self.write_config()
        if os.geteuid() == 0:
            # It reads its files after taking the postgres identity.
            for path in (self.workdir, ini, self.workdir / "userlist.txt"):
                os.chmod(path, 0o755 if path.is_dir() else 0o644)
        self.launch(self.command(ini), cwd=self.workdir)

    def answers(self) -> bool:
        """Whether it accepts TCP connections right now."""
        return accepts_connections(self.port)
