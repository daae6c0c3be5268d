"""The working tree as a clean clone would hold it, copied elsewhere (to install it with pip)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tests.support.servers import ROOT


def checkout_files() -> list[str]:
    """What a clean clone of the working tree would hold: tracked and new files, not ignored ones."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.decode()
    return [
        name
        for name in listed.split("\0")
        if name and ((ROOT / name).is_file() or (ROOT / name).is_symlink())
    ]


def copy_checkout(target: Path) -> None:
    """Copy what a clean clone would hold into `target`, symbolic links as links (petstore/sql)."""
    for name in checkout_files():
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / name).is_symlink():
            (target / name).symlink_to((ROOT / name).readlink())
        else:
            shutil.copy2(ROOT / name, target / name)
