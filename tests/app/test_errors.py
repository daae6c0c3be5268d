"""The table of Error codes (petstore.errors.ERRORS) is the one list: what the app answers is in it."""

from __future__ import annotations

import ast
from pathlib import Path

from petstore import errors

PACKAGE = Path(errors.__file__).resolve().parent


def literal_codes() -> list[tuple[str, int | None, str]]:
    """(code, status or None, where) of every APIError(...) and error_response(...) with literal words."""
    found = []
    for path in sorted(PACKAGE.glob("**/*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        ours = {"APIError", "error_response"} if path.name == "errors.py" else set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "petstore.errors":
                ours |= {alias.name for alias in node.names}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
                continue
            if node.func.id not in ours:
                continue
            arguments = {str(index): value for index, value in enumerate(node.args)}
            arguments.update({keyword.arg or "": keyword.value for keyword in node.keywords})
            if node.func.id == "APIError":
                code = arguments.get("2") or arguments.get("code")
            elif node.func.id == "error_response":
                code = arguments.get("1") or arguments.get("code")
            else:
                continue
            status = arguments.get("0") or arguments.get("status")
            if isinstance(code, ast.Constant) and isinstance(code.value, str):
                known = status.value if isinstance(status, ast.Constant) else None
                found.append((code.value, known, f"{path.name}:{node.lineno}"))
    return found


def test_the_app_answers_only_codes_of_the_table_with_their_statuses() -> None:
    found = literal_codes()
    assert {code for code, _status, _where in found} >= {"api_key_banned", "service_unavailable"}
    wrong = [
        (code, status, where)
        for code, status, where in found
        if code not in errors.ERRORS or status not in (None, errors.ERRORS[code][0])
    ]
    assert wrong == []


def test_werkzeug_errors_get_codes_and_messages_of_the_table() -> None:
    for status, code in errors.CODES.items():
        assert errors.ERRORS[code][0] == status
    for status, message in errors.MESSAGES.items():
        assert errors.ERRORS[errors.CODES[status]] == (status, message)
    assert errors.codes_of(429) == ("rate_limited", "api_key_banned")
