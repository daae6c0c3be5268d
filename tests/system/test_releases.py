"""A release on one host under a mixed load (issue 28 §2): gunicorn's USR2 re-exec starts the new
code beside the old on the same listening socket, then TERM stops the old master gracefully.
No answer other than 200 or 201, no connection error, every 201 a row.

The host runs the release that the link `current` points at, as deploy/install.sh's checkout
would be: gunicorn is started with that link as its working directory (PWD), so that its re-exec
changes into the link again and finds the new release. The new release here is a second
checkout of this commit that says another version (its own dist-info first on sys.path).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from petstore import config, db, keys, migrations
from tests.support.checks import Answer, call
from tests.support.databases import empty_database
from tests.support.load import MixedLoad
from tests.support.nginx import DeployedGunicorn, Nginx
from tests.support.servers import LOOPBACK, ROOT, WORKER_FAILED, alive, free_port

NEW_VERSION = "1.1.0.post1"


def git(*args: str) -> None:
    subprocess.run(["git", *args], cwd=ROOT, capture_output=True, timeout=120, check=True)


@pytest.fixture
def releases(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """Two checkouts of this commit, the second saying NEW_VERSION; removed at the end."""
    old, new = tmp_path / "releases" / "old", tmp_path / "releases" / "new"
    for checkout in (old, new):
        git("worktree", "add", "--detach", str(checkout), "HEAD")
    info = new / f"petstore-{NEW_VERSION}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: petstore\nVersion: {NEW_VERSION}\n", encoding="utf-8"
    )
    try:
        yield old, new
    finally:
        for checkout in (old, new):
            git("worktree", "remove", "--force", str(checkout))


def point(link: Path, target: Path) -> None:
    """Make `link` lead to `target` in one step (a rename), as a deploy does."""
    staged = link.with_name(link.name + ".new")
    staged.symlink_to(target)
    os.replace(staged, link)


def read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def wait_for(condition: Callable[[], bool], within: float, what: str) -> None:
    """Poll `condition` until it holds; fail naming `what` after `within` seconds."""
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"not within {within} s: {what}"
        time.sleep(0.1)


@contextmanager
def keyed_database(database_url: str, label: str) -> Iterator[tuple[str, str]]:
    """An empty database `<test db>_<label>`, migrated, and a key of ample budget: (its URL, the key)."""
    with empty_database(database_url, f"_{label}") as database:
        with db.connect(config.from_environ({"DATABASE_URL": database})) as conn:
            migrations.upgrade(conn)
            key, _row = keys.issue_key(conn, "enterprise", label, 1_000_000, 10_000_000)
        yield database, key


def test_usr2_replaces_the_running_version_without_a_refused_request(
    releases: tuple[Path, Path], database_url: str, tmp_path: Path
) -> None:
    old, new = releases
    current = tmp_path / "current"
    point(current, old)
    pidfile = tmp_path / "gunicorn.pid"
    port = free_port()
    url = f"http://{LOOPBACK}:{port}"
    with keyed_database(database_url, "release") as (database, key):
        environ = {
            **{k: v for k, v in os.environ.items() if not k.startswith("PETSTORE_")},
            "DATABASE_URL": database,
            "RATELIMIT_STORAGE_URI": "memory://",
            "BIND": f"{LOOPBACK}:{port}",
            "PWD": str(current),
            "PYTHONUNBUFFERED": "1",
        }
        # A directory of the operator's, which both masters share during the release.
        environ["PROMETHEUS_MULTIPROC_DIR"] = str(tmp_path / "metrics")
        # The venv's script, as deploy/install.sh runs it: `python -m gunicorn` re-execs as
        # gunicorn/__main__.py, whose folder first on sys.path hides the standard library's http.
        command = [str(Path(sys.executable).parent / "gunicorn"), "-c", "deploy/gunicorn.conf.py"]
        with (tmp_path / "gunicorn.log").open("wb") as log:
            master = subprocess.Popen(
                [*command, "--pid", str(pidfile), "wsgi:app"],
                cwd=current,
                env=environ,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            wait_for(lambda: versions(url) == {"1.1.0"}, 30, "the old release answers")
            with under_load(url, key, "release") as load:
                started = time.monotonic()
                # The release: the link to the new checkout, USR2, then TERM to the old master
                # once the new one's workers answer.
                point(current, new)
                os.kill(master.pid, signal.SIGUSR2)
                # gunicorn's new master writes its pid beside the old one's, with ".2"
                successor = pidfile.with_name(pidfile.name + ".2")
                wait_for(lambda: read_pid(successor) is not None, 30, "a new master")
                new_master = read_pid(successor)
                wait_for(lambda: NEW_VERSION in versions(url), 30, "the new release answers")
                os.kill(master.pid, signal.SIGTERM)
                master.wait(timeout=30)
                # Its parent gone, the new master takes the pid file's name.
                wait_for(lambda: read_pid(pidfile) == new_master, 10, "the pid file renamed")
                finished = time.monotonic()
            after = versions(url)
            metrics = call(url, "GET", "/metrics", timeout=10)
        finally:
            # The first master is this test's child; the one USR2 started is not (init reaps it).
            masters = [pid for pid in (master.pid, read_pid(pidfile)) if pid is not None]
            for pid in masters:
                if alive(pid):
                    os.kill(pid, signal.SIGTERM)
            others = [pid for pid in masters if pid != master.pid]
            wait_for(lambda: not any(alive(pid) for pid in others), 30, "the masters stopped")
            try:
                os.killpg(master.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            master.wait(timeout=10)
        assert_nothing_refused(load, database, (started, finished), after, "release")
        # As Gunicorn's with block checks for the servers it runs: no worker ended in an
        # exception, leaving what it had accepted unanswered (a stopping gthread worker did).
        assert WORKER_FAILED not in (tmp_path / "gunicorn.log").read_text(encoding="utf-8")
        assert metrics.status == 200
        assert "petstore_http_requests_total" in metrics.raw.decode(), metrics.raw[:300]


class ReleasedGunicorn(DeployedGunicorn):
    """gunicorn as deployed, running the checkout `source`, on the given loopback `port`."""

    def __init__(self, source: Path, port: int, environ: dict[str, str], log_path: Path) -> None:
        super().__init__(environ, log_path, workers=1, threads=4)
        self.source = source
        self.port = port
        self.url = f"http://{LOOPBACK}:{port}"
        self.address = f"{LOOPBACK}:{port}"
        self.environ["BIND"] = self.address

    def command(self) -> list[str]:
        """The checkout's own config file and app (its folder first on sys.path)."""
        return [sys.executable, "-m", "gunicorn", "-c", "deploy/gunicorn.conf.py", "wsgi:app"]

    def start(self) -> None:
        environ = {**os.environ, **self.environ, "PYTHONUNBUFFERED": "1"}
        self.launch(self.command(), cwd=self.source, env=environ)


def reload_without(proxy: Nginx, hosts: list[str], drained: str | None) -> None:
    """nginx's upstreams `hosts`, `drained` marked down; reloaded, and its old workers gone.

    A reload starts new workers with the new configuration; the old ones finish the requests
    they have (and close their upstream connections) and exit. Once they are gone, no request
    is on its way to the drained host.
    """
    proxy.upstreams = [f"{host} down" if host == drained else host for host in hosts]
    proxy.write_config()
    before = set(nginx_workers(proxy.pid))
    os.kill(proxy.pid, signal.SIGHUP)
    wait_for(lambda: not before & set(nginx_workers(proxy.pid)), 30, "nginx's old workers gone")


def nginx_workers(master: int) -> list[int]:
    """The pids of nginx's workers (the master's children)."""
    found = subprocess.run(
        ["pgrep", "-P", str(master)], capture_output=True, text=True, timeout=10
    ).stdout
    return [int(pid) for pid in found.split()]


def test_hosts_behind_nginx_are_replaced_one_at_a_time_without_a_refused_request(
    releases: tuple[Path, Path], database_url: str, tmp_path: Path
) -> None:
    old, new = releases
    with keyed_database(database_url, "rolling") as (database, key):
        environ = {"DATABASE_URL": database, "RATELIMIT_STORAGE_URI": "memory://"}
        with ExitStack() as stack:
            hosts = [
                stack.enter_context(
                    ReleasedGunicorn(old, free_port(), environ, tmp_path / f"old-{n}.log")
                )
                for n in range(2)
            ]
            addresses = [host.address for host in hosts]
            proxy = stack.enter_context(Nginx(addresses, tmp_path / "nginx"))
            with under_load(proxy.url, key, "rolling") as load:
                started = time.monotonic()
                for n, host in enumerate(hosts):
                    reload_without(proxy, addresses, drained=host.address)
                    host.stop()
                    replacement = ReleasedGunicorn(
                        new, host.port, environ, tmp_path / f"new-{n}.log"
                    )
                    stack.enter_context(replacement)
                    reload_without(proxy, addresses, drained=None)
                finished = time.monotonic()
            after = versions(proxy.url)
        assert_nothing_refused(
            load, database, (started, finished), after, "rolling release of 2 hosts"
        )
