"""docs/deploying.rst's "Patroni on one machine, step by step", run as written on loopback (as root):
etcd, two Patroni nodes from deploy/patroni.yml, HAProxy from deploy/haproxy.cfg, the role and
database, the migrations through HAProxy, every password in a file and none on a command line."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.support.patroni import get_json
from tests.support.programs import program
from tests.support.servers import ROOT, free_port

DEPLOYING = ROOT / "docs" / "deploying.rst"


def guide() -> str:
    """The commands between the guide's markers, as a reader copies them."""
    text = DEPLOYING.read_text(encoding="utf-8")
    block = text[text.index(".. patroni-guide-start") : text.index(".. patroni-guide-end")]
    code = block[block.index(".. code-block:: bash") + len(".. code-block:: bash") :]
    return textwrap.dedent(code).strip() + "\n"


@pytest.fixture
def workdir() -> Iterator[Path]:
    """The guide's PATRONI_DIR: one postgres may traverse (pytest's own are root's alone)."""
    if os.geteuid() != 0:
        pytest.skip("the guide runs as root (Patroni as the postgres user)")
    for name in ("etcd", "patroni", "haproxy", "psql", "runuser", "openssl", "curl"):
        program(name)
    path = Path(tempfile.mkdtemp(prefix="petstore-patroni-guide-"))
    path.chmod(0o755)
    yield path
    # Only what the guide started: each from its pid file, the whole session it leads.
    stop_haproxy(path / "haproxy.pid")
    for pid_file in (path / "db1" / "patroni.pid", path / "db2" / "patroni.pid", path / "etcd.pid"):
        stop_session(pid_file)
    shutil.rmtree(path, ignore_errors=True)


def stop_haproxy(pid_file: Path) -> None:
    """SIGTERM to the HAProxy the guide started in the background (-D), by its pid file."""
    try:
        os.kill(int(pid_file.read_text()), signal.SIGTERM)
    except (OSError, ValueError):
        return


def stop_session(pid_file: Path) -> None:
    """SIGTERM to the session the guide started with setsid (Patroni stops its PostgreSQL
    first), SIGKILL after 30 s."""
    try:
        pid = int(pid_file.read_text())
    except (OSError, ValueError):
        return
    for sig, wait in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def test_the_patroni_guide_runs_as_written(workdir: Path) -> None:
    commands = guide()
    environ = {
        **{name: value for name, value in os.environ.items() if not name.startswith("PG")},
        "PATH": f"{os.environ['PATH']}:/usr/sbin:/sbin",
        "PATRONI_DIR": str(workdir),
        "ETCD_PORT": str(free_port()),
        "ETCD_PEER_PORT": str(free_port()),
        "PG_PORTS": f"{free_port()} {free_port()}",
        "REST_PORTS": f"{free_port()} {free_port()}",
        "HAPROXY_PORT": str(free_port()),
    }
    environ.pop("DATABASE_URL", None)
    # A password never goes on a command line or into the URL: only variables and files.
    assert "password=" not in commands and ":$PATRONI_SUPERUSER_PASSWORD@" not in commands

    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", commands],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=240,
    )

    logs = "".join(
        f"\n--- {log}\n{log.read_text(errors='replace')[-3000:]}"
        for log in sorted(workdir.glob("**/*.log"))
    )
    assert done.returncode == 0, done.stdout + done.stderr + logs
    ports = environ["PG_PORTS"].split()
    # The service's ways in, without a password (it comes from the guide's .pgpass): writes
    # through HAProxy reach the primary; the read URL prefers the standby.
    found = {}
    os.environ["PGPASSFILE"] = str(workdir / "petstore.pgpass")
    try:
        for way, url in {
            "writes": f"postgresql://petstore@127.0.0.1:{environ['HAPROXY_PORT']}/petstore",
            "reads": f"postgresql://petstore@127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}/petstore"
            "?target_session_attrs=prefer-standby",
        }.items():
            with psycopg.connect(url, connect_timeout=10) as conn:
                found[way] = conn.execute(
                    "select current_user, pg_is_in_recovery(), to_regclass('pets') is not null"
                ).fetchone()
    finally:
        del os.environ["PGPASSFILE"]
    assert found == {"writes": ("petstore", False, True), "reads": ("petstore", True, True)}
    # One node leads, the other follows it synchronously (Patroni's REST API on each).
    roles = sorted(
        path
        for port in environ["REST_PORTS"].split()
        for path in ("primary", "sync")
        if get_json(f"http://127.0.0.1:{port}/{path}")[0] == 200
    )
    assert roles == ["primary", "sync"]
    # Every secret file is root's alone.
    for secret in [*workdir.glob("*.password"), *workdir.glob("*.pgpass")]:
        assert (secret.stat().st_uid, secret.stat().st_mode & 0o077) == (0, 0), secret
