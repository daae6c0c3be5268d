"""tests/support/programs.py: the system tests find Debian's programs outside a normal user's PATH,
and skip in one line naming the installer when a program is missing."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from tests.support import programs

ROOT = Path(__file__).resolve().parents[2]


def executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n", encoding="utf-8")
    path.chmod(0o755)
    return path


def test_a_program_in_sbin_is_found_without_sbin_on_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """pgbouncer in /usr/sbin, PATH a normal user's (no sbin): found, as a path to run."""
    sbin = executable(tmp_path / "usr" / "sbin" / "pgbouncer").parent
    monkeypatch.setenv("PATH", str(tmp_path / "usr" / "bin"))
    monkeypatch.setattr(programs, "SYSTEM_DIRS", (str(sbin),))

    assert programs.program("pgbouncer") == str(sbin / "pgbouncer")


def test_a_missing_program_skips_in_one_line_naming_its_installer(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(programs, "SYSTEM_DIRS", (str(tmp_path),))
    monkeypatch.setattr(programs.os, "geteuid", lambda: 0)

    with pytest.raises(pytest.skip.Exception) as skipped:
        programs.program("redis-sentinel")

    assert str(skipped.value) == (
        "redis-sentinel is not installed: install it as root with `bash .ci/install-redis-sentinel`"
    )


def test_a_missing_program_no_script_installs_says_where_it_comes_from(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """kubectl comes with the CI machines (no .ci/ script): the line says so, and where to get it."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(programs, "SYSTEM_DIRS", (str(tmp_path),))

    with pytest.raises(pytest.skip.Exception) as skipped:
        programs.program("kubectl")

    assert str(skipped.value) == (
        "kubectl is not installed: CI machines have it; install it as"
        " https://kubernetes.io/docs/tasks/tools/ says"
    )


@pytest.mark.parametrize(
    ("uid", "has_sudo", "command"),
    [
        (0, True, "bash .ci/install-nginx"),
        (1000, True, "sudo bash .ci/install-nginx"),
        # A plain Debian: no sudo, so root's password through su, in the checkout.
        (1000, False, "su -c 'bash .ci/install-nginx'"),
    ],
)
def test_the_hint_says_what_runs_as_root_on_this_machine(
    monkeypatch: pytest.MonkeyPatch, uid: int, has_sudo: bool, command: str
) -> None:
    monkeypatch.setattr(programs.os, "geteuid", lambda: uid)
    monkeypatch.setattr(
        programs.shutil, "which", lambda name, path=None: "/usr/bin/sudo" if has_sudo else None
    )

    assert programs.install_command("nginx") == command
    # Each word it names is a program or a file of this checkout.
    words = shlex.split(command)
    script = shlex.split(words[-1])[-1] if words[0] == "su" else words[-1]
    assert (ROOT / script).is_file()


def test_every_installer_named_is_a_script_of_ci() -> None:
    scripts = set(programs.INSTALLERS.values())
    assert scripts
    assert sorted(script for script in scripts if not (ROOT / script).is_file()) == []


def test_the_debian_system_directories_are_searched() -> None:
    assert {"/usr/sbin", "/sbin"} <= set(programs.SYSTEM_DIRS)
