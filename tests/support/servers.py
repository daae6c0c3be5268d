"""Real server processes for tests: gunicorn, Redis and a throwaway PostgreSQL, on loopback, always cleaned up."""

from __future__ import annotations

import http.client
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Self, TypeVar

import requests

from tests.support.programs import program

ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = "127.0.0.1"
T = TypeVar("T")
# A gunicorn access log format that names the worker (as `<pid>`), for Gunicorn.wait_for_workers.
ACCESS_PID_FORMAT = "'access %(p)s %(s)s %(r)s'"
ACCESS_PID_HEALTHZ = re.compile(r"access <(\d+)> 200 GET /healthz")


# Ports this process has handed out: the kernel may give a just-closed port again, and two
# listeners of one server (nginx's HTTP and HTTPS) asked for in a row must not get the same one.
_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now and that no earlier call returned."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((LOOPBACK, 0))
            port: int = sock.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def pid_logging_gunicorn(
    database_url: str,
    storage_uri: str,
    log_path: Path,
    environ: Mapping[str, str],
    *,
    workers: int,
    threads: int,
    server_class: type[Gunicorn] | None = None,
) -> Gunicorn:
    """A gunicorn (not started) on this limiter storage, logging each request's worker pid
    (ACCESS_PID_FORMAT), with `environ` on top."""
    gunicorn_args = [
        "--access-logfile -",
        f"--access-logformat {ACCESS_PID_FORMAT}",
        # A worker takes no more connections than it has threads, so that a burst spreads
        # over the workers instead of queueing inside the first one to wake up.
        f"--worker-connections {threads}",
        # Several gunicorns may run at once; the default control socket path is shared.
        "--no-control-socket",
    ]
    return (server_class or Gunicorn)(
        {
            "DATABASE_URL": database_url,
            "RATELIMIT_STORAGE_URI": storage_uri,
            "GUNICORN_CMD_ARGS": " ".join(gunicorn_args),
            **environ,
        },
        log_path,
        workers=workers,
        threads=threads,
    )


def accepts_connections(port: int, host: str = LOOPBACK, timeout: float = 1.0) -> bool:
    """Whether something accepts TCP connections on `host`:`port` right now."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def alive(pid: int) -> bool:
    """Whether a process `pid` exists (a zombie included: its parent has not reaped it yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def log_tail(path: Path, lines: int = 40) -> str:
    """The last lines of a log file, or a note that there is none."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return f"(no log at {path})"
    return "\n".join(text.splitlines()[-lines:])


def run_every(steps: Sequence[Callable[[], None]]) -> None:
    """Run each step even when one before it raised (stopping a stack of servers); then raise the first error."""
    errors = []
    for step in steps:
        try:
            step()
        except Exception as exc:  # keep stopping the others
            errors.append(exc)
    if errors:
        raise errors[0]


class ServerFailed(RuntimeError):
    """A server process exited early or did not answer in time."""


def poll_until(
    probe: Callable[[], T], done: Callable[[T], bool], within: float, interval: float = 0.05
) -> T:
    """Call `probe` every `interval` s until `done` holds for its value or `within` s passed; the last value."""
    deadline = time.monotonic() + within
    while True:
        value = probe()
        if done(value) or time.monotonic() > deadline:
            return value
        time.sleep(interval)


class Service:
    """Started on entering a with block and stopped on leaving it, also when the start fails half-way."""

    def start(self) -> object:
        """Start it (each subclass says how)."""
        raise NotImplementedError

    def stop(self) -> None:
        """Stop whatever runs; idempotent."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
        if exc_type is None:
            self.check_stopped()

    def check_stopped(self) -> None:
        """What leaving the with block without an error checks once it is stopped: nothing,
        unless a subclass says."""


class ServerProcess(Service):
    """A server program on a free loopback port, as a child in a session of its own with its output in a log file.

    launch() waits (bounded) until it answers; stop() sends `stop_signal`, waits (bounded) and
    SIGKILLs what is left of its process group; every error carries the tail of the log.
    """

    name = "server"
    # What answering means, for the error when it never does.
    ready = "answer"
    stop_signal = signal.SIGTERM
    log_mode = "wb"
    poll_interval = 0.1
    # A network namespace (`ip netns`) to run the program in; None: this machine's own network.
    netns: str | None = None

    def __init__(self, log_path: Path, *, start_timeout: float, stop_timeout: float) -> None:
        self.log_path = log_path
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        """The program's process id, which is also its process group's."""
        assert self.process is not None, f"{self.name} is not started"
        return self.process.pid

    def launch(
        self,
        command: Sequence[str],
        *,
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """Run `command` with its output in the log, then wait_healthy(); stop it if that fails."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.netns is not None:
            # `ip netns exec` execs the program: the pid and process group stay the program's.
            command = [program("ip"), "netns", "exec", self.netns, *command]
        with self.log_path.open(self.log_mode) as log:
            # A session of its own, so that the whole process group can be killed at the end.
            self.process = subprocess.Popen(
                command,
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise

    def answers(self) -> bool:
        """Whether the program answers right now (each subclass says how to ask)."""
        raise NotImplementedError

    def wait_healthy(self) -> None:
        """Poll answers() until it is true, the process exits or start_timeout passes; raise with the log then."""
        assert self.process is not None
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerFailed(
                    f"{self.name} exited early with status {self.process.returncode}; "
                    f"log:\n{self.log()}"
                )
            if self.answers():
                return
            time.sleep(self.poll_interval)
        raise ServerFailed(
            f"{self.name} did not {self.ready} within {self.start_timeout} s; log:\n{self.log()}"
        )

    def stop(self) -> None:
        """Send stop_signal, wait (bounded), then SIGKILL its process group if anything is left; idempotent."""
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(self.stop_signal)
            try:
                process.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                pass
        # Children (gunicorn's workers, nginx's) are in its process group: none may outlive the test.
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(timeout=self.stop_timeout)
        self.process = None

    def log(self) -> str:
        """The tail of the log, for assertion messages."""
        return log_tail(self.log_path)


# What gunicorn's arbiter logs when a worker's run() raises (arbiter.py, spawn_worker).
WORKER_FAILED = "Exception in worker process"


class Gunicorn(ServerProcess):
    """`python -m gunicorn wsgi:app` from the repository root on a free loopback port, as a context manager."""

    name = "gunicorn"
    ready = "answer /healthz"

    def __init__(
        self,
        environ: Mapping[str, str],
        log_path: Path,
        *,
        workers: int = 2,
        threads: int = 4,
        start_timeout: float = 30.0,
        stop_timeout: float = 10.0,
    ) -> None:
        super().__init__(log_path, start_timeout=start_timeout, stop_timeout=stop_timeout)
        self.environ = dict(environ)
        self.workers = workers
        self.threads = threads
        self.url = f"http://{LOOPBACK}:{self.port}"
        # Where this test reaches it (another address for an app on a host of its own).
        self.health_host = LOOPBACK
        # The checkout it runs from: gunicorn imports the app (and reads a config) from there.
        self.tree = ROOT

    def check_stopped(self) -> None:
        """Fail if a worker ended in an exception.

        gunicorn replaces such a worker and answers on, but the connections the worker had
        accepted went unanswered (a stopping gthread worker did this once in CI, see
        petstore/gunicorn_glue.py): a test whose load happened to miss them must not pass.
        """
        if WORKER_FAILED in self.log_path.read_text(errors="replace"):
            raise ServerFailed(f"a gunicorn worker ended in an exception; log:\n{self.log()}")

    def command(self) -> list[str]:
        """The command line: the interpreter of the running venv, gthread workers, loopback only."""
        return [
            sys.executable,
            "-m",
            "gunicorn",
            "--bind",
            f"{LOOPBACK}:{self.port}",
            "--workers",
            str(self.workers),
            "--threads",
            str(self.threads),
            "--worker-class",
            "gthread",
            # SIGTERM waits this long for running requests; stop() waits a little more.
            "--graceful-timeout",
            str(max(1, int(self.stop_timeout) - 2)),
            "--error-logfile",
            "-",
            # Several gunicorns run at once here; the default control socket path is shared.
            "--no-control-socket",
            "wsgi:app",
        ]

    def start(self) -> None:
        """Start gunicorn and wait (bounded) until /healthz answers; raise with its log otherwise."""
        environ = {**os.environ, **self.environ, "PYTHONUNBUFFERED": "1"}
        self.launch(self.command(), cwd=self.tree, env=environ)

    def answers(self) -> bool:
        """Whether GET /healthz answers 200 right now."""
        return self.healthz() == 200

    def worker_pids(self) -> list[int]:
        """The pids of the master's worker processes right now."""
        children = Path(f"/proc/{self.pid}/task/{self.pid}/children")
        try:
            return [int(pid) for pid in children.read_text().split()]
        except FileNotFoundError:
            return []

    def wait_for_workers(self, within: float = 20.0, *, answering: bool = False) -> list[int]:
        """Wait (bounded) until the master has all its workers; their pids.

        With `answering`, also until each worker has answered a GET /healthz (bursts of them,
        on new connections): all have booted, so that a burst spreads over all of them. That
        reads the worker's pid from the access log, so the access log format must be
        ACCESS_PID_FORMAT.
        """
        deadline = time.monotonic() + within
        pids = poll_until(self.worker_pids, lambda pids: len(pids) >= self.workers, within)
        if len(pids) < self.workers:
            raise ServerFailed(f"{len(pids)} of {self.workers} workers:\n{self.log()}")
        if not answering:
            return pids

        def healthz(_: int) -> None:
            requests.get(f"{self.url}/healthz", headers={"Connection": "close"}, timeout=10.0)

        while True:
            with ThreadPoolExecutor(max_workers=4 * self.workers) as executor:
                list(executor.map(healthz, range(4 * self.workers)))
            answered = set(ACCESS_PID_HEALTHZ.findall(self.log_path.read_text()))
            if len(answered) >= self.workers:
                return self.worker_pids()
            if time.monotonic() > deadline:
                raise ServerFailed(
                    f"only {len(answered)} of {self.workers} workers answer; {self.log()}"
                )

    def healthz(self) -> int | None:
        """The status of GET /healthz, or None when nothing answers."""
        connection = http.client.HTTPConnection(self.health_host, self.port, timeout=2)
        try:
            connection.request("GET", "/healthz")
            return connection.getresponse().status
        except (OSError, http.client.HTTPException):
            return None
        finally:
            connection.close()


class ThrowawayPostgres(Service):
    """A PostgreSQL cluster of the test's own (petstore.dev.embedded) in `datadir`; stopped on exit."""

    def __init__(self, datadir: Path) -> None:
        self.datadir = datadir

    def start(self) -> str:
        """Start the cluster (created on first use) and return its server URL; idempotent."""
        from petstore.dev import embedded

        server_url: str = embedded.ensure_running(self.datadir)
        return server_url

    def stop(self) -> None:
        """Fast shutdown: every connection is cut; idempotent."""
        from petstore.dev import embedded

        embedded.stop(self.datadir)

    def url(self, dbname: str = "postgres") -> str:
        """The libpq URL of database `dbname` on this cluster."""
        from petstore.dev import embedded

        database_url: str = embedded.url(self.datadir, dbname)
        return database_url

    def migrated_database(self, dbname: str) -> str:
        """Create database `dbname` here if it is missing and migrate it; its libpq URL."""
        from petstore import config, db, migrations
        from petstore.dev.server import ensure_database

        ensure_database(self.url(), dbname)
        database_url = self.url(dbname)
        with db.connect(config.from_environ({"DATABASE_URL": database_url})) as conn:
            migrations.upgrade(conn)
        return database_url


class SilentServer(Service):
    """A TCP server on a free loopback port that accepts connections and never answers, as a context manager."""

    def __init__(self) -> None:
        self.port = free_port()
        self.accepted: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    def start(self) -> None:
        """Listen and accept in a background thread, handing each connection to handle()."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((LOOPBACK, self.port))
        listener.listen(128)
        # A timeout on accept() lets the thread notice stop() within a moment.
        listener.settimeout(0.1)
        self._listener = listener
        self._thread = threading.Thread(target=self._accept, name=type(self).__name__, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        """Accept until stopped."""
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                connection, _address = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.handle(connection)

    def handle(self, connection: socket.socket) -> None:
        """Keep the connection open, unread, so that the client waits for a reply."""
        self.accepted.append(connection)

    def stop(self) -> None:
        """Stop accepting and close every connection; idempotent."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for connection in self.accepted:
            connection.close()
        self.accepted.clear()
