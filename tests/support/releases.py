"""Releases as deploy/install.sh makes them, for the system tests: copies of this checkout to build
them from, a wheelhouse that pip installs from with no index, a system user, and install.sh's
release steps (between its `release-start` and `release-end` lines) to run."""

from __future__ import annotations

import base64
import functools
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.support.servers import ROOT, poll_until

INSTALL_SCRIPT = ROOT / "deploy" / "install.sh"
# The Python the releases' venvs are made with: Debian's, which any user may run (this venv's may
# be root's alone, such as root's pyenv), with its venv module (.ci/install-python3-venv).
SYSTEM_PYTHON = "/usr/bin/python3"
# A made-up dependency whose version differs between two releases (its import says which).
MARKER = "petstore-release-marker"


def copy_checkout(dest: Path) -> Path:
    """This checkout's files (tracked and new ones, none ignored) copied to `dest`, uncommitted
    changes included, as a checkout install.sh builds a release from."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if not os.path.lexists(source):  # deleted, not committed yet
            continue
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target, follow_symlinks=False)
    return dest


def depend_on_marker(checkout: Path, marker_version: str, version: str | None = None) -> Path:
    """The checkout's package requires MARKER==marker_version (and says `version`, when given)."""
    setup_cfg = checkout / "setup.cfg"
    text = setup_cfg.read_text(encoding="utf-8")
    text = text.replace(
        "install_requires =\n", f"install_requires =\n    {MARKER}=={marker_version}\n"
    )
    if version is not None:
        text = re.sub(r"^version = .*$", f"version = {version}", text, count=1, flags=re.M)
    setup_cfg.write_text(text, encoding="utf-8")
    return checkout


def marker_wheel(directory: Path, version: str) -> Path:
    """A wheel of MARKER `version`: a .pth line that imports its module at every start of the
    venv's Python, which then writes "petstore-release-marker VERSION (pid N)" to stderr (the
    log of a gunicorn master started in that venv)."""
    name = MARKER.replace("-", "_")
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}.py": (
            "import os, sys\n"
            f"sys.stderr.write('{MARKER} {version} (pid %d)\\n' % os.getpid())\n"
            "sys.stderr.flush()\n"
        ),
        f"{name}.pth": f"import {name}\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {MARKER}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    records = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        records.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
    records.append(f"{info}/RECORD,,")
    wheel = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in {**files, f"{info}/RECORD": "\n".join(records) + "\n"}.items():
            archive.writestr(path, text)
    return wheel


def build_wheelhouse(directory: Path, checkout: Path) -> dict[str, str]:
    """The wheels a release of `checkout` installs (its dependencies as SYSTEM_PYTHON resolves
    them, setuptools to build it, MARKER 1.0 and 2.0) in `directory`; the environment that makes
    pip install from there alone."""
    for version in ("1.0", "2.0"):
        marker_wheel(directory, version)
    pip = [sys.executable, "-m", "pip", "--python", SYSTEM_PYTHON, "--quiet"]
    for command in (
        ["wheel", "--wheel-dir", str(directory), "--find-links", str(directory), str(checkout)],
        ["download", "--dest", str(directory), "setuptools>=68,<81"],
    ):
        done = subprocess.run([*pip, *command], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
    return {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(directory)}


@contextmanager
def open_directory(prefix: str) -> Iterator[Path]:
    """A temporary directory a service user may enter (pytest's own are root's alone); removed."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def system_user(name: str) -> Iterator[str]:
    """The name of a system user (created by the caller or the script it runs); removed after."""
    try:
        yield name
    finally:
        subprocess.run(["userdel", name], capture_output=True, timeout=30)
        subprocess.run(["groupdel", name], capture_output=True, timeout=30)


def release_steps() -> str:
    """install.sh's release steps: its lines from `# release-start` to `# release-end`."""
    text = INSTALL_SCRIPT.read_text(encoding="utf-8")
    return text[text.index("# release-start") : text.index("# release-end")]


def system_python() -> None:
    """Skip (a failure under CI) when SYSTEM_PYTHON cannot make a venv."""
    made = subprocess.run(
        [SYSTEM_PYTHON, "-c", "import ensurepip, venv"], capture_output=True, timeout=30
    )
    if made.returncode != 0:
        pytest.skip(
            f"{SYSTEM_PYTHON} with its venv module is not installed: install it as root with "
            "`bash .ci/install-python3-venv`"
        )


def stop_masters(pid_file: Path) -> None:
    """Stop the gunicorn masters of `pid_file` and `pid_file`.2 (started with setsid, a release's
    new master in its predecessor's process group): SIGTERM to each group, SIGKILL after 30 s."""
    groups = set()
    for path in (pid_file, pid_file.with_name(pid_file.name + ".2")):
        try:
            groups.add(os.getpgid(int(path.read_text())))
        except (OSError, ValueError):
            continue
    for group in groups:
        for sig, wait in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(group, sig)
            except ProcessLookupError:
                break
            exists = functools.partial(group_exists, group)
            if not poll_until(exists, lambda still: not still, wait, 0.1):
                break


def group_exists(group: int) -> bool:
    """Whether any process of process group `group` exists."""
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def point(link: Path, target: str | Path) -> None:
    """Make `link` lead to `target` in one step (a rename), as a release does."""
    staged = link.with_name(link.name + ".new")
    staged.symlink_to(target)
    os.replace(staged, link)


def read_pid(path: Path) -> int | None:
    """The pid a gunicorn pid file holds; None while it is missing or half-written."""
    try:
        return int(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
