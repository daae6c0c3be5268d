"""deploy/install.sh, the single-host deployment of docs/deploying.rst, run for real on loopback (as root).

It runs with a throwaway role and database on the test's PostgreSQL server, a throwaway system
user, its environment file and gunicorn's pid file and log in a temporary directory, this
virtualenv, and a free port; the gunicorn it starts, the database, the role and the user are
removed afterwards.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import conninfo, sql

from tests.support.nginx import Nginx, nginx_binary
from tests.support.servers import LOOPBACK, ROOT, alive, free_port, poll_until

SCRIPT = ROOT / "deploy" / "install.sh"


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


def stop_gunicorn(pid_file: Path) -> None:
    """SIGTERM the gunicorn the script started (a session of its own), then SIGKILL what is left."""
    if not pid_file.exists():
        return
    pid = int(pid_file.read_text())
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.killpg(pid, signal.SIGKILL)


@pytest.fixture
def service_user() -> Iterator[str]:
    """The name of a system user the script creates; removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("deploy/install.sh runs as root (it creates a system user)")
    name = f"petstore_t{os.getpid()}"
    yield name
    subprocess.run(["userdel", name], capture_output=True, timeout=30)
    subprocess.run(["groupdel", name], capture_output=True, timeout=30)


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A temporary directory the service user may enter (pytest's own are root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="petstore-install-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def run_script(environ: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT)],
        cwd=cwd,  # the script finds the checkout itself
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )


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


def test_install_script_serves_a_key_on_a_fresh_role_and_database(
    throwaway: tuple[str, str], service_user: str, workdir: Path
) -> None:
    admin_url, name = throwaway
    server = conninfo.conninfo_to_dict(admin_url)
    bind = f"{LOOPBACK}:{free_port()}"
    state = workdir / "state"
    environ = {
        **{key: value for key, value in os.environ.items() if key != "DATABASE_URL"},
        "PETSTORE_DB": name,
        "PETSTORE_DB_HOST": str(server.get("host", LOOPBACK)),
        "PETSTORE_DB_PORT": str(server.get("port", 5432)),
        "PG_ADMIN_URL": admin_url,
        "BIND": bind,
        "PETSTORE_ENV": str(workdir / "petstore.env"),
        "PETSTORE_STATE_DIR": str(state),
        "PETSTORE_VENV": sys.prefix,
        "PETSTORE_USER": service_user,
        "RATELIMIT_STORAGE_URI": "memory://",
    }
    try:
        done = run_script(environ, workdir)
        assert done.returncode == 0, done.stdout + done.stderr
        first_pid = int((state / "gunicorn.pid").read_text())
        first_env = (workdir / "petstore.env").read_text()
        first_users = [process_user(pid) for pid in (first_pid, *workers_of(first_pid))]
        # Run again with another setting (as docs/deploying.rst suggests for Redis): the service
        # restarts with it. (Not Redis itself here: this virtualenv may be built on a Python
        # that only root can run in full, such as root's pyenv.)
        again = run_script({**environ, "PETSTORE_PROXY_COUNT": "2"}, workdir)
        assert again.returncode == 0, again.stdout + again.stderr
        second_pid = int((state / "gunicorn.pid").read_text())
        second_users = [process_user(pid) for pid in (second_pid, *workers_of(second_pid))]
        second_environ = environ_of(second_pid)
    finally:
        stop_gunicorn(state / "gunicorn.pid")

    key = re.search(r"^KEY=(ps_[A-Za-z0-9_-]{43})$", done.stdout, re.MULTILINE)
    assert key, done.stdout
    assert re.search(r"^HTTP/1\.1 200 OK\r?$", done.stdout, re.MULTILINE), done.stdout
    assert "X-RateLimit-Limit: 60" in done.stdout
    assert done.stdout.rstrip().endswith(
        f"(user {service_user}); stop it with: kill $(cat {state}/gunicorn.pid)"
    )
    # The service and its worker (memory://: one) ran as the service user, never as root.
    assert first_users == [service_user, service_user]
    assert (state.stat().st_uid, stat.S_IMODE(state.stat().st_mode)) == (
        pwd.getpwnam(service_user).pw_uid,
        0o750,
    )

    env_file = workdir / "petstore.env"
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    settings = dict(line.split("=", 1) for line in first_env.splitlines())
    assert settings["BIND"] == bind
    database = conninfo.conninfo_to_dict(settings["DATABASE_URL"])
    assert (database["user"], database["dbname"]) == (name, name)

    # The second run stopped the first gunicorn and started one with the new setting, with the
    # same database password (the service's connections stay valid).
    assert f"stopping the gunicorn of an earlier run (pid {first_pid})" in again.stdout
    assert re.search(r"^HTTP/1\.1 200 OK\r?$", again.stdout, re.MULTILINE), again.stdout
    assert f"gunicorn runs as pid {second_pid} (user {service_user})" in again.stdout
    assert second_pid != first_pid and not alive(first_pid)
    assert second_environ["PETSTORE_PROXY_COUNT"] == "2"
    assert second_users == [service_user, service_user]
    assert "Already running" not in (state / "gunicorn.log").read_text()
    second_settings = dict(line.split("=", 1) for line in env_file.read_text().splitlines())
    assert second_settings["PETSTORE_PROXY_COUNT"] == "2"
    assert second_settings["DATABASE_URL"] == settings["DATABASE_URL"]
    with psycopg.connect(settings["DATABASE_URL"]) as conn:  # the role owns the database
        owner = conn.execute(
            "select pg_get_userbyid(datdba) from pg_database where datname = current_database()"
        ).fetchone()
        keys = conn.execute("select label from api_keys order by id").fetchall()
    assert owner == (name,)
    # The second run kept the key the first one made, and says how to rotate it.
    assert keys == [("first",)]
    assert f"KEY={key.group(1)}" in again.stdout
    assert "the first key of an earlier run, kept: key 1; to replace it, run" in again.stdout
    key_file = workdir / "petstore.key"
    assert key_file.read_text() == key.group(1) + "\n"
    assert (key_file.stat().st_uid, stat.S_IMODE(key_file.stat().st_mode)) == (0, 0o600)


def test_install_script_refuses_code_the_service_user_could_change(
    throwaway: tuple[str, str], service_user: str, workdir: Path
) -> None:
    """A checkout the service user may write (its own, say) is refused in one line, nothing run."""
    admin_url, name = throwaway
    subprocess.run(["useradd", "--system", "--user-group", service_user], check=True, timeout=30)
    venv = workdir / "venv"
    (venv / "bin").mkdir(parents=True)
    shutil.chown(venv, service_user)
    environ = {
        **{key: value for key, value in os.environ.items() if key != "DATABASE_URL"},
        "PETSTORE_DB": name,
        "PG_ADMIN_URL": admin_url,
        "PETSTORE_ENV": str(workdir / "petstore.env"),
        "PETSTORE_STATE_DIR": str(workdir / "state"),
        "PETSTORE_VENV": str(venv),
        "PETSTORE_USER": service_user,
    }
    (venv / "bin" / "petstore").write_text("#!/bin/sh\n")
    (venv / "bin" / "petstore").chmod(0o755)

    done = run_script(environ, workdir)

    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"refusing: {service_user} may write {venv}, the code: make root own it"
    ]
    assert not (workdir / "petstore.env").exists()


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
