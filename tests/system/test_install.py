"""deploy/install.sh, the single-host deployment of docs/deploying.rst, run for real on loopback (as root).

It runs on a copy of this checkout, with a throwaway role and database on the test's PostgreSQL
server, a throwaway system user, its releases, environment file, pid file and log in a temporary
directory, a wheelhouse (pip installs with no index) and a free port; the gunicorn it starts, the
database, the role and the user are removed afterwards. A first install, then re-runs under a
mixed load: on the same checkout with another setting, after a "git pull" that brings a
migration, with a release that cannot start, and with a Python the service user cannot run.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import conninfo, sql

from petstore import config, db, keys
from tests.support.checks import call
from tests.support.load import MixedLoad, assert_nothing_refused, under_load
from tests.support.nginx import Nginx, nginx_binary
from tests.support.programs import program
from tests.support.releases import (
    INSTALL_SCRIPT,
    SYSTEM_PYTHON,
    build_wheelhouse,
    copy_checkout,
    open_directory,
    stop_masters,
    system_python,
    system_user,
)
from tests.support.servers import LOOPBACK, ROOT, alive, free_port, poll_until


@pytest.fixture
def throwaway(database_url: str) -> Iterator[tuple[str, str]]:
    """(admin URL, role and database name); both dropped afterwards."""
    admin_url = conninfo.make_conninfo(database_url, dbname="postgres")
    name = f"petstore_install_{os.getpid()}"
    yield admin_url, name
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(
            sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name))
        )
        admin.execute(sql.SQL("drop role if exists {}").format(sql.Identifier(name)))


@pytest.fixture
def service_user() -> Iterator[str]:
    """The name of a system user the script creates; removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("deploy/install.sh runs as root (it creates a system user)")
    with system_user(f"petstore_t{os.getpid()}") as name:
        yield name


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A temporary directory the service user may enter (pytest's own are root's alone)."""
    with open_directory("petstore-install-") as path:
        yield path


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """pip's environment for installing a release of this checkout with no index, built once."""
    system_python()
    directory = tmp_path_factory.mktemp("wheels")
    return build_wheelhouse(directory, copy_checkout(directory / "checkout"))


def run_script(environ: dict[str, str], checkout: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(checkout / "deploy" / "install.sh")],
        cwd=checkout.parent,  # the script finds the checkout itself
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )


def run_script_under_load(
    environ: dict[str, str], checkout: Path, url: str, key: str, label: str
) -> tuple[subprocess.CompletedProcess[str], MixedLoad, tuple[float, float]]:
    """install.sh, with a mixed load on `url` from its step 3 (once the release is built: nothing
    before touches the service, and a build under load takes four times as long) to its end;
    what it printed, the load, and when the load's window began and ended."""
    out, err = checkout.parent / f"{label}.out", checkout.parent / f"{label}.err"
    with out.open("w") as stdout, err.open("w") as stderr:
        process = subprocess.Popen(
            ["bash", str(checkout / "deploy" / "install.sh")],
            cwd=checkout.parent,
            env=environ,
            stdout=stdout,
            stderr=stderr,
        )
    try:
        poll_until(lambda: "== 3." in out.read_text() or process.poll() is not None, bool, 300)
        # The window is step 3 to the end: a release refused at once may end within the load's
        # first 2 s (CI saw none of its answers counted when the window began after them).
        began = time.monotonic()
        with under_load(url, key, label) as load:
            process.wait(timeout=300)
            window = (began, time.monotonic())
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    done = subprocess.CompletedProcess(
        process.args, process.returncode, out.read_text(), err.read_text()
    )
    return done, load, window


def root_only_python(directory: Path) -> Path:
    """A Python whose standard library only root may read, as root's pyenv under /root: a copy of
    SYSTEM_PYTHON that its ._pth file sends to the library through a directory of root's alone."""
    stdlib = subprocess.run(
        [SYSTEM_PYTHON, "-c", "import sysconfig; print(sysconfig.get_path('stdlib'))"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.strip()
    hidden = directory / "root-only"
    hidden.mkdir(parents=True, mode=0o700)
    (hidden / "lib").symlink_to(stdlib)
    python = directory / "python3"
    shutil.copy(os.path.realpath(SYSTEM_PYTHON), python)
    (directory / "python3._pth").write_text(
        f"{hidden}/lib\n{hidden}/lib/lib-dynload\nimport site\n"
    )
    return python


def process_user(pid: int) -> str:
    """The user a process runs as (its real, effective, saved and file-system uids all agree)."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    line = next(line for line in status if line.startswith("Uid:"))
    uids = set(line.split()[1:])
    assert len(uids) == 1, line
    return pwd.getpwuid(int(uids.pop())).pw_name


def workers_of(pid: int) -> list[int]:
    """The child processes of `pid` (gunicorn's workers)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(child) for child in children]


def environ_of(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode().split("=", 1) for entry in entries if b"=" in entry)


def interpreter_of(pid: int) -> str:
    """The interpreter a gunicorn master was started with (its argv[0]: a release's venv)."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()


def test_install_script_releases_again_and_again_without_refusing_a_request(
    throwaway: tuple[str, str],
    service_user: str,
    workdir: Path,
    wheelhouse: dict[str, str],
) -> None:
    admin_url, name = throwaway
    server = conninfo.conninfo_to_dict(admin_url)
    bind = f"{LOOPBACK}:{free_port()}"
    url = f"http://{bind}"
    state, home = workdir / "state", workdir / "home"
    checkout = copy_checkout(workdir / "checkout")
    environ = {
        **{key: value for key, value in os.environ.items() if key != "DATABASE_URL"},
        **wheelhouse,
        "PETSTORE_DB": name,
        "PETSTORE_DB_HOST": str(server.get("host", LOOPBACK)),
        "PETSTORE_DB_PORT": str(server.get("port", 5432)),
        "PG_ADMIN_URL": admin_url,
        "BIND": bind,
        "PETSTORE_HOME": str(home),
        "PETSTORE_PYTHON": SYSTEM_PYTHON,
        "PETSTORE_ENV": str(workdir / "petstore.env"),
        "PETSTORE_STATE_DIR": str(state),
        "PETSTORE_USER": service_user,
        "PETSTORE_LOGROTATE": str(workdir / "logrotate" / "petstore"),
        "RATELIMIT_STORAGE_URI": "memory://",
    }
    pid_file = state / "gunicorn.pid"
    log = state / "gunicorn.log"

    def master() -> int:
        return int(pid_file.read_text())

    try:
        started = time.monotonic()
        done = run_script(environ, checkout)
        print(f"\nfirst install: {time.monotonic() - started:.1f} s")
        assert done.returncode == 0, done.stdout + done.stderr
        first_pid = master()
        first_release = (home / "current").resolve()
        first_env = (workdir / "petstore.env").read_text()
        first_users = [process_user(pid) for pid in (first_pid, *workers_of(first_pid))]
        first_interpreter = interpreter_of(first_pid)
        settings = dict(line.split("=", 1) for line in first_env.splitlines())

        # The log rotated by the logrotate part install.sh wrote, as logrotate's daily run does
        # (forced): what gunicorn logged so far in gunicorn.log.1, its next lines in gunicorn.log.
        before_rotation = log.read_text()
        rotated = subprocess.run(
            [
                program("logrotate"),
                "--force",
                "--state",
                str(workdir / "logrotate.state"),
                environ["PETSTORE_LOGROTATE"],
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        marker = call(url, "GET", "/v1/pets").headers["x-request-id"]
        after_rotation = poll_until(log.read_text, lambda text: marker in text, 10.0)

        def connect() -> db.Connection:
            return db.connect(config.from_environ({"DATABASE_URL": settings["DATABASE_URL"]}))

        with connect() as conn:
            load_key, _row = keys.issue_key(conn, "enterprise", "load", 1_000_000, 10_000_000)

        # 1. Again on the same checkout, with another setting (as docs/deploying.rst suggests
        # for Redis; not Redis itself here), under load: a new master, the new setting.
        again, load, same = run_script_under_load(
            {**environ, "PETSTORE_PROXY_COUNT": "2"}, checkout, url, load_key, "same"
        )
        assert again.returncode == 0, again.stdout + again.stderr
        assert_nothing_refused(load, connect, same, "install.sh again on the same checkout")
        second_pid = master()
        second_release = (home / "current").resolve()
        second_users = [process_user(pid) for pid in (second_pid, *workers_of(second_pid))]
        second_environ = environ_of(second_pid)
        second_interpreter = interpreter_of(second_pid)

        # 2. "git pull": the checkout brings a migration the code needs, under load.
        (checkout / "sql" / "0999_release_note.sql").write_text(
            "alter table pets add column if not exists release_note text;\n"
        )
        pulled, load, migrated = run_script_under_load(environ, checkout, url, load_key, "pulled")
        assert pulled.returncode == 0, pulled.stdout + pulled.stderr
        assert_nothing_refused(load, connect, migrated, "install.sh after a pull with a migration")
        third_pid = master()
        third_release = (home / "current").resolve()
        ready = call(url, "GET", "/readyz", timeout=10)
        third_interpreter = interpreter_of(third_pid)
        kept_after_pull = sorted((home / "releases").iterdir())

        # 3. A release that cannot start (its app fails to load), under load: refused, the one
        # before serves on.
        wsgi = checkout / "wsgi.py"
        wsgi.write_text(wsgi.read_text() + '\nraise RuntimeError("this release cannot start")\n')
        broken, load, failed = run_script_under_load(environ, checkout, url, load_key, "broken")
        kept_after_broken = sorted((home / "releases").iterdir())
        assert_nothing_refused(load, connect, failed, "install.sh with a release that cannot start")

        # 4. A Python the service user cannot run, as root's pyenv under /root.
        python = root_only_python(workdir / "python")
        unrunnable = run_script({**environ, "PETSTORE_PYTHON": str(python)}, checkout)
        after = call(url, "GET", "/healthz", timeout=10)
        last_pid = master()
    finally:
        stop_masters(pid_file)

    key = re.search(r"^KEY=(ps_[A-Za-z0-9_-]{43})$", done.stdout, re.MULTILINE)
    assert key, done.stdout
    assert re.search(r"^HTTP/1\.1 200 OK\r?$", done.stdout, re.MULTILINE), done.stdout
    assert "X-RateLimit-Limit: 60" in done.stdout
    assert "== 6. gunicorn as" in done.stdout and "in the background (no systemd" in done.stdout
    assert done.stdout.rstrip().endswith(
        f"(user {service_user}) on {first_release}; stop it with: kill $(cat {pid_file})"
    )
    # The release: its own venv, which the master runs, as the service user, never as root.
    assert first_release.parent == home / "releases"
    assert Path(first_interpreter).parent == first_release / "venv" / "bin"
    assert first_users == [service_user, service_user]
    assert (state.stat().st_uid, stat.S_IMODE(state.stat().st_mode)) == (
        pwd.getpwnam(service_user).pw_uid,
        0o750,
    )

    env_file = workdir / "petstore.env"
    assert (
        env_file.stat().st_uid,
        env_file.stat().st_gid,
        stat.S_IMODE(env_file.stat().st_mode),
    ) == (
        0,
        pwd.getpwnam(service_user).pw_gid,
        0o640,
    )
    assert settings["BIND"] == bind

    logrotate = Path(environ["PETSTORE_LOGROTATE"]).read_text()
    assert f"\n{log} {{\n    su {service_user} {service_user}\n" in logrotate
    assert rotated.returncode == 0, rotated.stdout + rotated.stderr
    assert "Listening at:" in before_rotation
    assert (state / "gunicorn.log.1").read_text().startswith(before_rotation)
    # Emptied, not replaced: gunicorn writes on at its start (>>, O_APPEND), no hole of zeros.
    assert marker in after_rotation and "Listening at:" not in after_rotation
    assert not after_rotation.startswith("\0")
    database = conninfo.conninfo_to_dict(settings["DATABASE_URL"])
    assert (database["user"], database["dbname"]) == (name, name)

    # 1. A new release and master beside the first, with the new setting and the same database
    # password (the service's connections stay valid); the first master gone.
    assert (
        f"releasing beside gunicorn (pid {first_pid}), which serves {first_release}" in again.stdout
    )
    assert re.search(r"^HTTP/1\.1 200 OK\r?$", again.stdout, re.MULTILINE), again.stdout
    assert second_release != first_release
    assert Path(second_interpreter).parent == second_release / "venv" / "bin"
    assert second_pid != first_pid and not alive(first_pid)
    assert second_environ["PETSTORE_PROXY_COUNT"] == "2"
    assert second_users == [service_user, service_user]
    second_settings = dict(line.split("=", 1) for line in env_file.read_text().splitlines())
    assert second_settings["DATABASE_URL"] == settings["DATABASE_URL"]
    with psycopg.connect(settings["DATABASE_URL"]) as conn:  # the role owns the database
        owner = conn.execute(
            "select pg_get_userbyid(datdba) from pg_database where datname = current_database()"
        ).fetchone()
        labels = conn.execute("select label from api_keys order by id").fetchall()
        note = conn.execute(
            "select 1 from information_schema.columns "
            "where table_name = 'pets' and column_name = 'release_note'"
        ).fetchone()
    assert owner == (name,)
    # The re-runs kept the key the first one made, and say how to rotate it.
    assert labels == [("first",), ("load",)]
    assert f"KEY={key.group(1)}" in again.stdout
    assert "the first key of an earlier run, kept: key 1; to replace it, run" in again.stdout
    key_file = workdir / "petstore.key"
    assert key_file.read_text() == key.group(1) + "\n"
    assert (key_file.stat().st_uid, stat.S_IMODE(key_file.stat().st_mode)) == (0, 0o600)

    # 2. The new code's migration applied by the new code, which serves; the oldest release
    # removed, the one before kept (to go back to).
    assert "applied: 0999_release_note.sql" in pulled.stdout
    assert note == (1,)
    assert ready.status == 200 and ready.body["schema"] == "0999_release_note"
    assert Path(third_interpreter).parent == third_release / "venv" / "bin"
    assert kept_after_pull == sorted([second_release, third_release])

    # 3. Refused in one line of why, the release removed, current and the master as they were.
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert re.search(
        r"^the release \S+ does not serve: the new master \(pid \d+\) exited; "
        rf"current is {third_release} again, and gunicorn \(pid {third_pid}\) serves it on",
        broken.stderr,
        re.MULTILINE,
    ), broken.stderr
    assert "this release cannot start" in broken.stderr
    assert kept_after_broken == kept_after_pull

    # 4. Refused before anything changed: the same master serves the same release.
    assert unrunnable.returncode == 1
    assert re.search(
        rf"^refusing: {service_user} cannot run {home}/releases/\S+/venv/bin/python ",
        unrunnable.stderr,
        re.MULTILINE,
    ), unrunnable.stderr
    assert (home / "current").resolve() == third_release
    assert after.status == 200
    assert last_pid == third_pid
    assert sorted((home / "releases").iterdir()) == kept_after_pull


def test_install_script_refuses_code_the_service_user_could_change(
    throwaway: tuple[str, str], service_user: str, workdir: Path
) -> None:
    """A home the service user may write (its own, say) is refused in one line, nothing run."""
    admin_url, name = throwaway
    subprocess.run(["useradd", "--system", "--user-group", service_user], check=True, timeout=30)
    home = workdir / "home"
    home.mkdir()
    shutil.chown(home, service_user)
    environ = {
        **{key: value for key, value in os.environ.items() if key != "DATABASE_URL"},
        "PETSTORE_DB": name,
        "PG_ADMIN_URL": admin_url,
        "PETSTORE_ENV": str(workdir / "petstore.env"),
        "PETSTORE_STATE_DIR": str(workdir / "state"),
        "PETSTORE_HOME": str(home),
        "PETSTORE_USER": service_user,
    }

    done = subprocess.run(
        ["bash", str(INSTALL_SCRIPT)],
        cwd=workdir,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"refusing: {service_user} may write {home}, the code: make root own it"
    ]
    assert not (workdir / "petstore.env").exists()
    assert list((home / "releases").iterdir()) == []


# docs/deploying.rst, the single host, step 4: start nginx, or reload the one that runs.
NGINX_START_OR_RELOAD = "nginx -t && { nginx -s reload 2>/dev/null || nginx; }"


def test_the_deployment_guide_starts_nginx_when_it_is_not_running_and_reloads_it_when_it_is(
    workdir: Path,
) -> None:
    """No systemd: `nginx -s reload` alone fails without a running nginx (`invalid PID number`)."""
    assert f"       {NGINX_START_OR_RELOAD}\n" in (ROOT / "docs" / "deploying.rst").read_text()
    proxy = Nginx([f"{LOOPBACK}:{free_port()}"], workdir / "nginx", workers=1)
    main = proxy.write_config()
    # `nginx` as the guide runs it, on the test's own config, prefix and ports.
    wrapper = workdir / "bin" / "nginx"
    wrapper.parent.mkdir()
    wrapper.write_text(
        "#!/bin/sh\n"
        f'exec {nginx_binary()} -p {proxy.prefix}/ -c {main} -e {proxy.error_log_path} "$@"\n'
    )
    wrapper.chmod(0o755)
    environ = {**os.environ, "PATH": f"{wrapper.parent}:{os.environ['PATH']}"}
    pid_file = proxy.prefix / "nginx.pid"
    try:
        started = subprocess.run(
            ["bash", "-c", NGINX_START_OR_RELOAD], env=environ, capture_output=True, timeout=30
        )
        assert started.returncode == 0, started.stderr
        first = int(pid_file.read_text())
        workers = workers_of(first)
        reloaded = subprocess.run(
            ["bash", "-c", NGINX_START_OR_RELOAD], env=environ, capture_output=True, timeout=30
        )
        assert reloaded.returncode == 0, reloaded.stderr
        assert int(pid_file.read_text()) == first and alive(first)
        # A reload starts new workers in the same master.
        renewed = poll_until(lambda: workers_of(first), lambda now: not set(now) & set(workers), 10)
        assert renewed and proxy.answers()
    finally:
        if pid_file.exists():
            stop_nginx(int(pid_file.read_text()))


def stop_nginx(pid: int) -> None:
    """SIGQUIT the nginx master the test started (daemonized), wait (bounded), SIGKILL if left."""
    os.kill(pid, signal.SIGQUIT)
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if alive(pid):
        os.killpg(os.getpgid(pid), signal.SIGKILL)
