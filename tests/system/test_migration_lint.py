"""`make lint` lints the migrations with squawk (issue 40 §4): a migration that blocks writes on
pets fails it, naming the rule; the same change written to take no such lock passes.

Each test runs the Makefile's own target on a copy of sql/ with one migration added
(MIGRATIONS=dir), so that what is checked is the command `make lint` runs, with its flags.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tests.support.servers import ROOT

# Writes on pets wait for each: the index's build holds SHARE, the check's scan of the table
# holds the ALTER's ACCESS EXCLUSIVE.
BLOCKING = (
    "create index pets_name_idx on pets (name);\n"
    "alter table pets add constraint pets_name_short check (length(name) < 200);\n"
)
# The same two, as a migration outside a transaction builds them without blocking writes: the
# index concurrently, the check NOT VALID (validated later under a lock that lets writes pass).
NOT_BLOCKING = {
    "0009_pets_name_index.sql": (
        "-- petstore: no transaction\n"
        "-- squawk-disable-assume-in-transaction\n"
        "create index concurrently if not exists pets_name_idx on pets (name);\n"
    ),
    "0010_pets_name_short.sql": (
        "alter table pets add constraint pets_name_short check (length(name) < 200) not valid;\n"
    ),
}


def lint(migrations: dict[str, str], directory: Path) -> subprocess.CompletedProcess[str]:
    """`make lint-migrations` (what `make lint` runs) on sql/ and `migrations` added, in a copy."""
    shutil.copytree(ROOT / "sql", directory)
    for name, text in migrations.items():
        (directory / name).write_text(text, encoding="utf-8")
    return subprocess.run(
        ["make", "--no-print-directory", "lint-migrations", f"MIGRATIONS={directory}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def findings(done: subprocess.CompletedProcess[str]) -> list[str]:
    """squawk's finding lines (its gcc format: path:line:column: warning: rule message)."""
    return [line for line in done.stdout.splitlines() if ": warning: " in line]


def test_a_migration_that_blocks_writes_on_pets_fails_make_lint_naming_the_rule(
    tmp_path: Path,
) -> None:
    bad = tmp_path / "sql" / "0009_pets_name.sql"

    done = lint({bad.name: BLOCKING}, bad.parent)

    assert done.returncode != 0, done.stdout + done.stderr
    # One finding per statement, each naming its rule; none in the shipped files (sql/0005's
    # baseline is ignored there).
    found = [
        (line.split(":")[0], line.split(": warning: ")[1].split()[0]) for line in findings(done)
    ]
    assert found == [
        (str(bad), "require-concurrent-index-creation"),
        (str(bad), "constraint-missing-not-valid"),
    ], done.stdout


def test_the_shipped_migrations_and_their_lock_free_successors_pass_make_lint(
    tmp_path: Path,
) -> None:
    done = lint(NOT_BLOCKING, tmp_path / "sql")

    assert done.returncode == 0, done.stdout + done.stderr
    assert findings(done) == []
