"""README.rst, the first thing a user runs: it renders, and it documents every setting."""

from __future__ import annotations

import re
from pathlib import Path

import docutils.core
import docutils.utils
import pytest
import yaml

from petstore import config

README = Path(__file__).resolve().parents[2] / "README.rst"


@pytest.mark.parametrize("name", ["README.rst", "CHANGELOG.rst", "CONTRIBUTING.rst"])
def test_readme_renders_without_warnings(name: str) -> None:
    """README.rst and its two companions render as reStructuredText without a warning."""
    docutils.core.publish_doctree(
        (README.parent / name).read_text(encoding="utf-8"),
        settings_overrides={"halt_level": docutils.utils.Reporter.WARNING_LEVEL, "report_level": 5},
    )


def test_pre_commit_pins_the_ruff_of_make_lint() -> None:
    """.pre-commit-config.yaml runs the ruff version setup.cfg's dev extra installs."""
    pinned = re.search(r"^\s*ruff==(\S+)$", (README.parent / "setup.cfg").read_text(), re.M)
    hooks = yaml.safe_load((README.parent / ".pre-commit-config.yaml").read_text())
    (ruff,) = [repo for repo in hooks["repos"] if repo["repo"].endswith("/ruff-pre-commit")]
    assert pinned is not None
    assert ruff["rev"] == f"v{pinned.group(1)}"
    assert {hook["id"] for hook in ruff["hooks"]} == {"ruff-check", "ruff-format"}


def test_readme_documents_every_setting() -> None:
    text = README.read_text(encoding="utf-8")
    missing = [name for name in config.SETTINGS if f"``{name}``" not in text]
    assert not missing


def test_readme_shows_the_two_commands_first() -> None:
    text = README.read_text(encoding="utf-8")
    assert text.index("make run") < text.index("Configuration")
    assert text.index("make test") < text.index("Configuration")


def test_readme_shows_the_install_script_exactly() -> None:
    """The deployment section's literal block is deploy/install.sh, line for line."""
    lines = README.read_text(encoding="utf-8").splitlines()
    script = (README.parent / "deploy" / "install.sh").read_text(encoding="utf-8").splitlines()
    start = lines.index("    " + script[0])
    shown = [line.removeprefix("    ") for line in lines[start : start + len(script)]]
    assert shown == script


def test_readme_layout_names_every_module() -> None:
    """Each module of the package, by its path or by its name on its folder's line."""
    text = README.read_text(encoding="utf-8")
    layout = text[text.index("\nLayout\n") :]
    package = README.parent / "petstore"
    missing = []
    for path in sorted(package.glob("**/*.py")):
        module = path.relative_to(README.parent).as_posix()
        folder = f"{path.parent.relative_to(README.parent).as_posix()}/"
        if path.name == "__init__.py" and path.parent != package:
            continue
        if module not in layout and not (folder in layout and path.name in layout):
            missing.append(module)
    assert not missing
