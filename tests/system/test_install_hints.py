"""The skip lines' hints, run as written: each .ci/install-* script through the command a missing
program's skip names, and the line a user without sudo gets from them."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.support import programs
from tests.support.servers import ROOT

AS_ROOT = ROOT / ".ci" / "as-root.sh"


@pytest.fixture(autouse=True)
def as_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("the installers' hints run as root (make test installs as root under CI)")


@pytest.mark.parametrize("name", sorted({s: n for n, s in programs.INSTALLERS.items()}.values()))
def test_the_hints_command_installs_the_program(name: str) -> None:
    """The command of `name`'s skip line, run by a shell in the checkout: it exits 0 and the
    program is there (an installed one is left as it is: the scripts are idempotent)."""
    done = subprocess.run(
        programs.install_command(name),
        shell=True,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )

    assert done.returncode == 0, done.stdout + done.stderr
    assert programs.find(name) is not None


def test_a_user_without_sudo_is_told_what_to_run_as_root() -> None:
    """A plain Debian has no sudo: the scripts stop in one line naming the command for root."""
    script = ".ci/install-nginx"
    done = subprocess.run(
        # As nobody, with no sudo on PATH; the helper's text is passed, so no directory needs to
        # be readable by nobody. $0 is the script that sources it.
        ["runuser", "-u", "nobody", "--", "env", "PATH=/nonexistent"]
        + ["/bin/bash", "-c", AS_ROOT.read_text(encoding="utf-8"), script],
        cwd="/",
        capture_output=True,
        text=True,
        timeout=30,
    )

    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        f"{script} installs Debian packages, which needs root, and there is no sudo here: "
        f"as root, run: {programs.install_command('nginx')}"
    ]
