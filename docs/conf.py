"""Sphinx configuration of the manual: `make docs` builds it with every warning an error."""

from __future__ import annotations

project = "Animal Store service"
author = "The Animal Store team"
copyright = "2026, The Animal Store team"
extensions: list[str] = []
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_title = "Animal Store service"
# Every reference must resolve: a broken :doc: or :ref: fails the build (make docs runs -W).
nitpicky = True
