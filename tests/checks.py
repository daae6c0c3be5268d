"""Assertions shared by the HTTP tests: the Error body every failure must answer."""

from __future__ import annotations

from typing import Any

from werkzeug.test import TestResponse

ERROR_FIELDS = {"code", "message", "status"}


def assert_error(response: TestResponse, status: int, code: str) -> dict[str, Any]:
    """The response is an Error JSON of this status and code, exactly {code, message, status} (+ errors on 400)."""
    assert response.status_code == status, response.get_data(as_text=True)
    assert response.mimetype == "application/json"
    body = response.get_json()
    assert isinstance(body, dict)
    extra = set(body) - ERROR_FIELDS
    assert ERROR_FIELDS <= set(body)
    assert extra <= ({"errors"} if status == 400 else set()), body
    assert body["code"] == code
    assert body["status"] == status
    assert isinstance(body["message"], str) and body["message"]
    if "errors" in body:
        assert isinstance(body["errors"], dict) and body["errors"]
    return body
