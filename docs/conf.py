"""Sphinx configuration of the manual: `make docs` builds it with every warning an error."""

from __future__ import annotations

project = "Animal Store service"
author = "The Animal Store team"
copyright = "2026, The Animal Store team"
extensions: list[str] = []
exclude_patterns = ["_build"]
# Furo: a readable theme Python projects use (pip, attrs, urllib3), with a sidebar of every
# section and highlighted code; each code block names its language (`code-block:: console`).
html_theme = "furo"
# A block without a language is shown as it is, never guessed at.
highlight_language = "none"
# Long lines wrap in code blocks; tables keep their columns' widths.
html_static_path = ["_static"]
html_css_files = ["petstore.css"]
html_title = "Animal Store service"
# Every reference must resolve: a broken :doc: or :ref: fails the build (make docs runs -W).
nitpicky = True
