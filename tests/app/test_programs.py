"""tests/support/programs.py: the system tests find Debian's programs outside a normal user's PATH,
and skip in one line naming the installer when a program is missing."""

from __future__ import annotations

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

    with pytest.raises(pytest.skip.Exception) as skipped:
        programs.program("redis-sentinel")

    assert str(skipped.value) == (
        "redis-sentinel is not installed: run `bash .ci/install-redis-sentinel` "
        "(it uses sudo unless you are root)"
    )


def test_every_installer_named_is_a_script_of_ci() -> None:
    scripts = set(programs.INSTALLERS.values())
    assert scripts
    assert sorted(script for script in scripts if not (ROOT / script).is_file()) == []


def test_the_debian_system_directories_are_searched() -> None:
    assert {"/usr/sbin", "/sbin"} <= set(programs.SYSTEM_DIRS)
