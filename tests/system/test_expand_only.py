"""Migrations are expand-only (CONTRIBUTING.rst): the code of the commit before the newest
migration still serves a database that today's code migrated (issue 28 §3).

The previous code runs from a git worktree of that commit, with this venv's interpreter and
dependencies and the worktree first on PYTHONPATH. It needs the repository's history: a shallow
clone fails here with the command that fetches it.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from petstore import config, db, keys, migrations
from tests.support.checks import call
from tests.support.databases import empty_database
from tests.support.servers import ROOT, Gunicorn


def git(*args: str) -> str:
    done = subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    return done.stdout.strip()


def commit_before_newest_migration() -> tuple[str, str]:
    """(the commit before the one that added sql/'s newest migration, that migration's name)."""
    if git("rev-parse", "--is-shallow-repository") == "true":
        pytest.fail(
            "this clone is shallow: the expand-only check runs the code of the commit before the "
            "newest migration, so it needs the history (git fetch --unshallow)"
        )
    newest = migrations.migrations()[-1].name
    # The commit that first added the file, in sql/ or where the migrations lived before
    # (petstore/sql/): not --follow, which loses a file that a merge moved.
    added = git(
        "log", "--diff-filter=A", "--format=%H", "--", f"sql/{newest}", f"petstore/sql/{newest}"
    )
    if not added:
        return git("rev-parse", "HEAD"), newest  # not committed yet: HEAD is the code before it
    return git("rev-parse", f"{added.splitlines()[-1]}^"), newest


class PreviousGunicorn(Gunicorn):
    """gunicorn serving the previous code: the worktree's wsgi.py, found before this checkout's."""

    def __init__(self, source: Path, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.source = source

    def start(self) -> None:
        environ = {
            **os.environ,
            **self.environ,
            "PYTHONPATH": str(self.source),
            "PYTHONUNBUFFERED": "1",
        }
        self.launch(self.command(), cwd=self.source, env=environ)


@pytest.fixture
def previous_code(tmp_path: Path) -> Iterator[tuple[Path, str, str]]:
    """A git worktree of the commit before the newest migration; removed at the end."""
    commit, newest = commit_before_newest_migration()
    worktree = tmp_path / "previous"
    git("worktree", "add", "--detach", str(worktree), commit)
    try:
        yield worktree, commit, newest
    finally:
        git("worktree", "remove", "--force", str(worktree))


def test_the_code_before_the_newest_migration_serves_the_migrated_database(
    previous_code: tuple[Path, str, str], database_url: str, tmp_path: Path
) -> None:
    worktree, commit, newest = previous_code
    assert not (worktree / "sql" / newest).exists()
    assert not (worktree / "petstore" / "sql" / newest).exists()
    with empty_database(database_url, "_expand") as url:
        settings = config.from_environ({"DATABASE_URL": url})
        with db.connect(settings) as conn:
            migrations.upgrade(conn)  # today's code migrates
            key, _row = keys.issue_key(conn, "enterprise", "expand-only", 100_000, 1_000_000)
        environ = {"DATABASE_URL": url, "RATELIMIT_STORAGE_URI": "memory://"}
        with PreviousGunicorn(worktree, environ, tmp_path / "gunicorn.log", workers=1) as server:
            headers = {"Authorization": f"Bearer {key}"}
            body = {"name": "Rex", "categoryId": 1, "status": "available"}
            created = call(server.url, "POST", "/v1/pets", headers=headers, json_body=body)
            pet_id = created.body["id"] if created.status == 201 else None
            answers = [
                created,
                call(server.url, "GET", "/v1/pets?limit=5", headers=headers),
                call(server.url, "GET", f"/v1/pets/{pet_id}", headers=headers),
                call(server.url, "GET", "/v1/pets/999999", headers=headers),
                call(server.url, "POST", "/v1/pets", headers=headers, json_body={"name": ""}),
                call(server.url, "GET", "/healthz"),
            ]
    print(
        f"\nthe code of {commit[:12]}, before {newest}, on today's schema: "
        + ", ".join(f"{a.method} {a.path} {a.status}" for a in answers)
    )

    # The previous code answered (its checkout lacks the newest migration, above); its /healthz
    # may say a version or not (before 1.1.0 it did not).
    assert answers[-1].body["status"] == "ok"
    assert [answer.status for answer in answers] == [201, 200, 200, 404, 400, 200]
    assert answers[0].body == {"id": pet_id, **body}
    assert answers[1].body == [answers[0].body]
    assert answers[2].body == answers[0].body
