"""Request ids, one JSON log line per request, and the JSON log format; every log line goes to stdout."""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import sys
import time
from datetime import UTC, datetime
from typing import Any

from flask import Response, g, request

log = logging.getLogger("petstore.access")

# An incoming X-Request-ID is kept when it is this sane; anything else gets a new id.
REQUEST_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")
QUIET_PATHS = ("/healthz", "/readyz", "/metrics")


# One encoder for every line: json.dumps(..., default=str) would build a new one each time.
ENCODER = json.JSONEncoder(default=str)


class JSONFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the record's extras, any traceback."""

    STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": timestamp(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if fields is not None:  # an access record: its fields, already a dict
            entry.update(fields)
        else:
            entry.update({k: v for k, v in vars(record).items() if k not in self.STANDARD})
        if record.exc_info:
            entry["traceback"] = self.formatException(record.exc_info)
        return ENCODER.encode(entry)


@functools.lru_cache(maxsize=4)
def second_of(seconds: int) -> str:
    """ISO 8601 of a whole second, UTC: made once per second, not once per line."""
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S")


def timestamp(created: float) -> str:
    """ISO 8601 with milliseconds, UTC, as datetime.isoformat(timespec="milliseconds") writes it."""
    seconds = int(created)
    return f"{second_of(seconds)}.{int((created - seconds) * 1000):03d}+00:00"


def configure(level: str = "INFO") -> None:
    """Send every log record to stdout as JSON (what wsgi.py and the gunicorn config use)."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(JSONFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # The JSON lines show no thread or process: spare logging their lookup for every record
    # (the Logging HOWTO's "Optimization" flags).
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False


def new_request_id() -> str:
    """128 random bits in hex, as uuid4().hex looks, without building a UUID object."""
    return os.urandom(16).hex()


def start_request() -> None:
    """Note when the request began and which id it goes by."""
    g.started = time.perf_counter()
    incoming = request.headers.get("X-Request-ID")
    g.request_id = incoming if incoming and REQUEST_ID.fullmatch(incoming) else new_request_id()


def finish_request(response: Response) -> None:
    """Echo the request id and log the request: id, method, path, status, duration, key id, IP.

    The record is made and handed to the handlers directly: Logger.info would also walk the
    stack to find the caller, which the JSON line does not show.
    """
    state = g._get_current_object()
    request_id = state.get("request_id") or new_request_id()
    response.headers["X-Request-ID"] = request_id
    req = request._get_current_object()  # type: ignore[attr-defined]
    path = req.path
    level = logging.DEBUG if path in QUIET_PATHS else logging.INFO
    if not log.isEnabledFor(level):
        return
    started = state.get("started")
    caller = state.get("caller")
    method, status = req.method, response.status_code
    record = log.makeRecord(log.name, level, __file__, 0, "%s %s %s", (method, path, status), None)
    record.fields = {
        "request_id": request_id,
        "method": method,
        "path": path,
        "status": status,
        "duration_ms": round((time.perf_counter() - started) * 1000, 2) if started else None,
        "key_id": caller["id"] if caller else None,
        "client_ip": req.remote_addr,
    }
    log.handle(record)
