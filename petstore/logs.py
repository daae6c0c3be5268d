"""Request ids, one JSON log line per request, and the JSON log format."""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from datetime import UTC, datetime
from typing import Any

from flask import Flask, Response, g, request

log = logging.getLogger("petstore.access")

# An incoming X-Request-ID is kept when it is this sane; anything else gets a new id.
REQUEST_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")
QUIET_PATHS = ("/healthz", "/readyz", "/metrics")


class JSONFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the record's extras, any traceback."""

    STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update({k: v for k, v in vars(record).items() if k not in self.STANDARD})
        if record.exc_info:
            entry["traceback"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure(level: str = "INFO") -> None:
    """Send every log record to stdout as JSON (what wsgi.py and the gunicorn config use)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JSONFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def start_request() -> None:
    """Note when the request began and which id it goes by."""
    g.started = time.perf_counter()
    incoming = request.headers.get("X-Request-ID", "")
    g.request_id = incoming if REQUEST_ID.fullmatch(incoming) else uuid.uuid4().hex


def finish_request(response: Response) -> Response:
    """Echo the request id and log the request: id, method, path, status, duration, key id, IP."""
    request_id = g.get("request_id") or uuid.uuid4().hex
    response.headers["X-Request-ID"] = request_id
    caller = g.get("caller")
    started = g.get("started")
    duration_ms = round((time.perf_counter() - started) * 1000, 2) if started else None
    level = logging.DEBUG if request.path in QUIET_PATHS else logging.INFO
    if log.isEnabledFor(level):
        log.log(
            level,
            "%s %s %s",
            request.method,
            request.path,
            response.status_code,
            extra={
                "request_id": request_id,
                "method": request.method,
                "path": request.path,
                "status": response.status_code,
                "duration_ms": duration_ms,
                "key_id": caller["id"] if caller else None,
                "client_ip": request.remote_addr,
            },
        )
    return response


def init_app(app: Flask) -> None:
    """Give every request an id and a log line; register first so the id exists for all hooks."""
    app.before_request(start_request)
    app.after_request(finish_request)
