"""Releases under a mixed load: on one host, docs/upgrading.rst's steps (deploy/install.sh's own),
each release in a venv of its own, gunicorn's USR2 starting the new master beside the old on the
same listening socket; and hosts behind nginx replaced one at a time (issue 28 §2). No answer
other than 200 or 201, no connection error, every 201 a row.

On one host the two releases differ in a dependency, as real releases do: a made-up package,
petstore-release-marker, 1.0 in the first and 2.0 in the second, which says its version in the
log when a master starts in its venv. Behind nginx, the new release is a second checkout of this
commit that says another version (its own dist-info first on sys.path).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
from psycopg import conninfo

from petstore import config, db, keys, migrations
from tests.support.databases import empty_database
from tests.support.load import assert_nothing_refused, under_load, versions
from tests.support.nginx import DeployedGunicorn, Nginx
from tests.support.releases import (
    SYSTEM_PYTHON,
    build_wheelhouse,
    copy_checkout,
    depend_on_marker,
    open_directory,
    stop_masters,
    system_python,
    system_user,
)
from tests.support.servers import LOOPBACK, ROOT, WORKER_FAILED, free_port

UPGRADING = ROOT / "docs" / "upgrading.rst"
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


def guide() -> list[str]:
    """The bash blocks of docs/upgrading.rst between its release guide's markers, as written."""
    text = UPGRADING.read_text(encoding="utf-8")
    part = text[text.index(".. release-guide-start") : text.index(".. release-guide-end")]
    blocks = []
    for chunk in part.split(".. code-block:: bash\n\n")[1:]:
        lines = []
        for line in chunk.splitlines():
            if line and not line.startswith(" "):
                break
            lines.append(line)
        blocks.append(textwrap.dedent("\n".join(lines)).strip() + "\n")
    return blocks


def run_guide(
    host: dict[str, str], checkout: Path, *steps: str
) -> subprocess.CompletedProcess[str]:
    """The guide's settings block, then `steps`, in one bash of the guide's (set -euo pipefail),
    as root from `checkout`, with the host's settings in the environment."""
    settings = guide()[0]
    script = "set -euo pipefail\n" + settings + "".join(steps)
    return subprocess.run(
        ["bash", "-c", script],
        cwd=checkout,
        env={**os.environ, **host},
        capture_output=True,
        text=True,
        timeout=300,
    )


def in_release(pid: int) -> set[str]:
    """The releases (their folders) whose files process `pid` has mapped: its venv's."""
    found = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        path = line.split(maxsplit=5)[-1]
        if "/releases/" in path:
            found.add(path.split("/releases/")[1].split("/")[0])
    return found


def test_a_release_runs_in_its_own_venv_and_one_that_cannot_start_leaves_the_old_serving(
    database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    if os.geteuid() != 0:
        pytest.skip("the guide runs as root (gunicorn as a system user)")
    system_python()
    with ExitStack() as stack:
        workdir = stack.enter_context(open_directory("petstore-releases-"))
        user = stack.enter_context(system_user(f"petstore_r{os.getpid()}"))
        subprocess.run(["useradd", "--system", "--user-group", user], check=True, timeout=30)
        database, key = stack.enter_context(keyed_database(database_url, "release"))
        state, home, env_file = workdir / "state", workdir / "home", workdir / "petstore.env"
        state.mkdir(mode=0o750)
        (state / "gunicorn.log").touch()
        for path in (state, state / "gunicorn.log"):
            shutil.chown(path, user, user)
        port = free_port()
        url = f"http://{LOOPBACK}:{port}"
        # A URL: the file is read by bash (install.sh's launch) and by gunicorn.conf.py (USR2).
        parts = conninfo.conninfo_to_dict(database)
        env_file.write_text(
            f"DATABASE_URL=postgresql://{parts['user']}@{parts['host']}:{parts['port']}/"
            f"{parts['dbname']}\nRATELIMIT_STORAGE_URI=memory://\nBIND={LOOPBACK}:{port}\n"
        )
        shutil.chown(env_file, "root", user)
        env_file.chmod(0o640)
        first = depend_on_marker(copy_checkout(workdir / "first"), "1.0")
        second = depend_on_marker(copy_checkout(workdir / "second"), "2.0", NEW_VERSION)
        wheels = build_wheelhouse(tmp_path_factory.mktemp("wheels"), first)
        host = {
            **wheels,
            "PETSTORE_HOME": str(home),
            "PETSTORE_STATE_DIR": str(state),
            "PETSTORE_ENV": str(env_file),
            "PETSTORE_USER": user,
            "PETSTORE_PYTHON": SYSTEM_PYTHON,
            "BIND": f"{LOOPBACK}:{port}",
        }
        pid_file = state / "gunicorn.pid"
        stack.callback(stop_masters, pid_file)
        _, build, release, again = guide()

        def master() -> int:
            return int(pid_file.read_text())

        # The first release, built, migrated and started as install.sh does.
        started = run_guide(host, first, build, 'point "$home/current" "$release" && launch\n')
        assert started.returncode == 0, started.stdout + started.stderr
        wait_for(lambda: versions(url) == {"1.1.0"}, 60, "the first release answers")
        first_master, first_release = master(), (home / "current").resolve()

        # The second: built and migrated, then the release under load.
        built = run_guide(host, second, build, 'echo "$release"\n')
        assert built.returncode == 0, built.stdout + built.stderr
        second_release = Path(built.stdout.splitlines()[-1])
        with under_load(url, key, "release") as load:
            began = time.monotonic()
            released = run_guide(host, second, f"release={second_release}\n", release)
            window = (began, time.monotonic())
        assert released.returncode == 0, released.stdout + released.stderr
        second_master = master()
        after = versions(url)
        second_mapped = in_release(second_master)

        # The first release deleted, then USR2 again on the second (as after a change of the
        # environment file): the master's interpreter is the second release's own.
        shutil.rmtree(first_release)
        with under_load(url, key, "again") as again_load:
            began = time.monotonic()
            renewed = run_guide(host, second, again)
            again_window = (began, time.monotonic())
        assert renewed.returncode == 0, renewed.stdout + renewed.stderr
        third_master = master()
        third_mapped = in_release(third_master)

        # A release that cannot start (a copy of the second whose app fails to load): refused,
        # current back to the second, whose master serves on.
        broken = home / "releases" / "broken"
        shutil.copytree(second_release, broken, symlinks=True)
        (wsgi,) = broken.glob("venv/lib/python*/site-packages/wsgi.py")
        wsgi.write_text(wsgi.read_text() + '\nraise RuntimeError("this release cannot start")\n')
        with under_load(url, key, "broken") as broken_load:
            began = time.monotonic()
            refused = run_guide(
                host,
                second,
                again.replace('release=$(readlink "$home/current")', f"release={broken}", 1),
            )
            broken_window = (began, time.monotonic())
        last_master = master()
        current = (home / "current").resolve()
        log = (state / "gunicorn.log").read_text(encoding="utf-8")

        def connect() -> db.Connection:
            return db.connect(config.from_environ({"DATABASE_URL": database}))

        assert_nothing_refused(load, connect, window, "USR2 from the first release to the second")
        assert after == {NEW_VERSION}
        # The new master runs the second release's venv (its mapped files are the second's only)
        # and its dependency: the marker 2.0, said when that master started.
        assert second_master != first_master
        assert second_mapped == {second_release.name}, second_mapped
        assert f"petstore-release-marker 1.0 (pid {first_master})" in log
        assert f"petstore-release-marker 2.0 (pid {second_master})" in log

        assert_nothing_refused(
            again_load, connect, again_window, "USR2 again, the first release deleted"
        )
        assert third_master not in (first_master, second_master)
        assert third_mapped == {second_release.name}, third_mapped
        assert f"petstore-release-marker 2.0 (pid {third_master})" in log

        assert_nothing_refused(broken_load, connect, broken_window, "a release that cannot start")
        assert refused.returncode == 1
        assert (
            f"the release {broken} does not serve: the new master (pid " in refused.stderr
            and f"current is {second_release} again, and gunicorn (pid {third_master}) serves it on"
            in refused.stderr
        ), refused.stderr
        assert "this release cannot start" in refused.stderr
        assert (last_master, current) == (third_master, second_release)
        # As Gunicorn's with block checks for the servers it runs: no worker ended in an
        # exception, leaving what it had accepted unanswered (a stopping gthread worker did).
        failed = [line for line in log.splitlines() if WORKER_FAILED in line]
        assert all("this release cannot start" in line for line in failed), failed


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
            load,
            lambda: db.connect(config.from_environ({"DATABASE_URL": database})),
            (started, finished),
            "rolling release of 2 hosts",
        )
    assert after == {NEW_VERSION}
