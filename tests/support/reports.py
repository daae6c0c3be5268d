"""Reports a test run shows at its end: tests add them, tests/conftest.py prints them in pytest's
terminal summary, after the progress dots."""

from __future__ import annotations

# (title, lines), in the order the tests added them.
REPORTS: list[tuple[str, list[str]]] = []


def add(title: str, lines: list[str]) -> None:
    """Show `lines` under `title` in the summary at the end of the run."""
    REPORTS.append((title, list(lines)))
