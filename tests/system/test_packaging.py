"""`pip install .` into a clean venv outside the checkout gives a working `petstore` command and app."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.support.databases import empty_database
from tests.support.releases import copy_checkout

ROOT = Path(__file__).resolve().parents[2]
MIGRATION = re.compile(r"^\d{4}_[a-z0-9_]+\.sql$")


def sql_files() -> list[str]:
    """The migrations' file names in the checkout's top-level sql/, in order."""
    return sorted(path.name for path in (ROOT / "sql").iterdir() if MIGRATION.match(path.name))


# In the venv: what `pip install .` printed.
INSTALL_LOG = "pip-install.log"


@pytest.fixture(scope="module")
def outside(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A working directory outside the checkout, so nothing is imported from it by accident."""
    path = tmp_path_factory.mktemp("outside")
    assert ROOT not in path.parents
    return path


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory, outside: Path) -> Path:
    """A clean venv with the project `pip install`ed into it (with its dependencies, from the index)."""
    # Install from a copy of the tree, as from a fresh clone: a stale build/ in the checkout
    # would otherwise hide files that the package data configuration forgets.
    source = tmp_path_factory.mktemp("source")
    copy_checkout(source)
    path = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(path)], check=True, cwd=outside)
    done = subprocess.run(
        [str(path / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check"]
        + [str(source)],
        cwd=outside,
        env=clean_environ(),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (path / INSTALL_LOG).write_text(done.stdout + done.stderr, encoding="utf-8")
    shutil.rmtree(source)  # the installed package must not need its source any more
    return path


def test_the_install_builds_through_pyproject_with_no_deprecation(venv: Path) -> None:
    """pyproject.toml names the build system: pip takes no legacy `setup.py` path, and neither
    pip nor setuptools prints a deprecation."""
    output = (venv / INSTALL_LOG).read_text(encoding="utf-8")
    assert "Building wheel for petstore (pyproject.toml)" in output
    assert "DEPRECATION" not in output
    assert "Deprecat" not in output


def clean_environ(**extra: str) -> dict[str, str]:
    """The environment without anything that would point Python at the checkout or its venv."""
    environ = {
        name: value
        for name, value in os.environ.items()
        if name not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
        and not name.startswith("PETSTORE_")
    }
    environ.pop("DATABASE_URL", None)
    return {**environ, **extra}


def run(
    venv: Path, outside: Path, program: str, *args: str, **environ: str
) -> subprocess.CompletedProcess[str]:
    """Run a program of the venv from outside the checkout; fail with its output unless it succeeds."""
    result = subprocess.run(
        [str(venv / "bin" / program), *args],
        cwd=outside,
        env=clean_environ(**environ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.fixture
def fresh_database_url(database_url: str) -> Iterator[str]:
    with empty_database(database_url, "_pkg") as url:
        yield url


def test_petstore_command_is_installed(venv: Path, outside: Path) -> None:
    result = run(venv, outside, "petstore", "--help")

    assert "Usage: petstore" in result.stdout
    for command in ("db", "keys", "serve"):
        assert re.search(rf"^\s+{command}\s", result.stdout, re.MULTILINE), result.stdout


def test_migrations_ship_inside_the_installed_package(venv: Path, outside: Path) -> None:
    in_checkout = sql_files()

    result = run(
        venv,
        outside,
        "python",
        "-c",
        "import petstore.migrations as m; print(m.__file__); print(*(x.name for x in m.migrations()))",
    )

    module_file, names = result.stdout.splitlines()
    assert Path(module_file).is_relative_to(venv)
    assert not Path(module_file).is_relative_to(ROOT)
    assert in_checkout
    assert names.split() == in_checkout


def test_installed_db_upgrade_migrates_a_fresh_database(
    venv: Path, outside: Path, fresh_database_url: str
) -> None:
    first = run(venv, outside, "petstore", "db", "upgrade", DATABASE_URL=fresh_database_url)
    second = run(venv, outside, "petstore", "db", "upgrade", DATABASE_URL=fresh_database_url)

    every_file = sql_files()
    assert every_file
    assert first.stdout.strip() == "applied: " + ", ".join(every_file)
    assert second.stdout.strip() == "schema is up to date"
    with psycopg.connect(fresh_database_url) as conn:
        tables = conn.execute(
            "select to_regclass('pets') is not null, to_regclass('api_keys') is not null"
        ).fetchone()
        applied = [
            row[0] for row in conn.execute("select name from schema_migrations order by name")
        ]
    assert tables == (True, True)
    assert applied == every_file


def test_installed_wsgi_app_serves_the_api(
    venv: Path, outside: Path, fresh_database_url: str
) -> None:
    run(venv, outside, "petstore", "db", "upgrade", DATABASE_URL=fresh_database_url)
    created = run(
        venv,
        outside,
        "petstore",
        "keys",
        "create",
        "--plan",
        "free",
        DATABASE_URL=fresh_database_url,
    )
    key = created.stdout.splitlines()[-1]

    script = (
        "import sys, wsgi\n"
        "print(wsgi.__file__)\n"
        "client = wsgi.app.test_client()\n"
        "headers = {'Authorization': 'Bearer ' + sys.argv[1]}\n"
        "created = client.post('/v1/pets', json={'name': 'Rex', 'categoryId': 1}, headers=headers)\n"
        "listed = client.get('/v1/pets', headers=headers)\n"
        "print(created.status_code, listed.status_code)\n"
        # The body ends with its own newline.
        "print(listed.get_data(as_text=True), end='')\n"
    )
    result = run(venv, outside, "python", "-c", script, key, DATABASE_URL=fresh_database_url)

    # The app's JSON log lines share stdout with what the script prints.
    printed = [line for line in result.stdout.splitlines() if not line.startswith('{"time": ')]
    module_file, statuses, listing = printed
    assert Path(module_file).is_relative_to(venv)
    assert statuses == "201 200"
    assert json.loads(listing) == [{"id": 1, "name": "Rex", "categoryId": 1}]


def test_the_editable_install_of_make_prints_no_setuptools_warning(
    tmp_path: Path, outside: Path
) -> None:
    """What `make run` does first (a current pip, then `pip install -e .`) prints no warning box.

    setuptools warns ("BuildBackendWarning: Editable installation ... Please be careful with
    folders in your working directory") when it must install a meta path finder, which it does
    unless every package sits in the folder of its name under one import root (setup.cfg's
    `package_dir = = .`; the migrations in sql/, reached through the link petstore/sql). The
    install finds every file of sql/ as the package's data, as the wheel does.
    """
    source = tmp_path / "source"
    copy_checkout(source)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, cwd=outside)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
    subprocess.run(
        [*pip, "install", "--quiet", "--upgrade", "pip"], check=True, env=clean_environ()
    )

    done = subprocess.run(
        [*pip, "install", "--quiet", "--no-deps", "-e", str(source)],
        cwd=outside,
        env=clean_environ(),
        capture_output=True,
        text=True,
    )

    assert done.returncode == 0, done.stderr
    output = done.stdout + done.stderr
    assert "BuildBackendWarning" not in output
    assert "DEPRECATION" not in output
    assert "Please be careful" not in output
    # Without the dependencies (--no-deps) petstore cannot be imported: find_spec locates it
    # without running it, and the migrations are listed where petstore.db reads them.
    found = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import importlib.util, pathlib; "
            "where = importlib.util.find_spec('petstore').submodule_search_locations[0]; "
            "print(*sorted(p.name for p in (pathlib.Path(where) / 'sql').glob('*.sql')))",
        ],
        cwd=outside,
        env=clean_environ(),
        capture_output=True,
        text=True,
        check=True,
    )
    assert found.stdout.split() == sql_files()
