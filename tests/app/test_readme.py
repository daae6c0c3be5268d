"""README.rst, the first thing a user runs: it renders, and it documents every setting."""

from __future__ import annotations

from pathlib import Path

import docutils.core
import docutils.utils

from petstore import config

README = Path(__file__).resolve().parents[2] / "README.rst"


def test_readme_renders_without_warnings() -> None:
    docutils.core.publish_doctree(
        README.read_text(encoding="utf-8"),
        settings_overrides={"halt_level": docutils.utils.Reporter.WARNING_LEVEL, "report_level": 5},
    )


def test_readme_documents_every_setting() -> None:
    text = README.read_text(encoding="utf-8")
    missing = [name for name in config.SETTINGS if f"``{name}``" not in text]
    assert not missing


def test_readme_shows_the_two_commands_first() -> None:
    text = README.read_text(encoding="utf-8")
    assert text.index("make run") < text.index("Configuration")
    assert text.index("make test") < text.index("Configuration")
