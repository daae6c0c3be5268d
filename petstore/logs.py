"""Request ids, one JSON log line per request, and the JSON log format; every log line goes to stdout."""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import re
import time
import weakref
from datetime import UTC, datetime
from typing import Any

from flask import Response, g, request

from petstore import periodic, tracing

log = logging.getLogger("petstore.access")

# An incoming X-Request-ID is kept when it is this sane; anything else gets a new id.
REQUEST_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")
QUIET_PATHS = ("/healthz", "/readyz", "/metrics")


# Lines at INFO and below wait at most this long in memory before they are written (StdoutHandler),
# and at most this many of them.
FLUSH_SECONDS = 0.1
MAX_PENDING = 1000

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
        ids = tracing.current_ids()
        if ids is not None:  # the request's trace, beside its request id
            entry["trace_id"], entry["span_id"] = ids
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


class StdoutHandler(logging.Handler):
    """Log lines to standard output, written in batches rather than one system call per line.

    A write releases the GIL, and under gunicorn's threads each release hands it to another
    thread and back: on the benchmark machine (POST /v1/pets, 1 worker × 4 threads) the request
    log cost 52 µs of CPU per request written line by line, 35 µs in batches. So a record at
    INFO or below (the request log) waits in memory, at most FLUSH_SECONDS, for a thread that
    writes everything pending at once. A WARNING or worse is written at once, after every line
    before it, and so is a full batch (MAX_PENDING lines); at exit, logging.shutdown writes the
    rest. A process killed with SIGKILL loses at most the last FLUSH_SECONDS of lines,
    the trade nginx's `access_log ... flush=` makes.

    The lines go to file descriptor 1 with os.write: no buffer of sys.stdout that a fork could
    copy half-written. A forked child (a gunicorn worker) starts with nothing pending and a
    writer of its own.
    """

    def __init__(self, fd: int = 1) -> None:
        super().__init__()
        self.fd = fd
        self.pending: list[str] = []
        self.writing = False  # whether this process has a writer thread (a fork has none)
        self.closed = False
        os.register_at_fork(after_in_child=functools.partial(forget_in_child, weakref.ref(self)))

    def emit(self, record: logging.LogRecord) -> None:
        """Format the record and keep it (called by Handler.handle, holding self.lock)."""
        try:
            if not self.writing:
                self.start_writer()
            self.pending.append(self.format(record))
            if record.levelno >= logging.WARNING or len(self.pending) >= MAX_PENDING:
                self.write_pending()
        except Exception:
            self.handleError(record)

    def flush(self) -> None:
        """Write every pending line now."""
        self.acquire()
        try:
            self.write_pending()
        finally:
            self.release()

    def close(self) -> None:
        """Write what is pending and stop the writer (logging.shutdown, a new configuration)."""
        self.flush()
        self.closed = True
        super().close()

    def write_pending(self) -> None:
        """Write the pending lines in one piece (the caller holds self.lock)."""
        if not self.pending:
            return
        data = ("\n".join(self.pending) + "\n").encode("utf-8", "backslashreplace")
        self.pending = []
        while data:
            data = data[os.write(self.fd, data) :]

    def start_writer(self) -> None:
        """Start this process's writer thread: flush every FLUSH_SECONDS while the handler lives."""
        self.writing = True
        periodic.every(
            FLUSH_SECONDS,
            self,
            write_while_open,
            "petstore-log-writer",
            "cannot write the request log",
            wait_first=True,
        )


def write_while_open(handler: StdoutHandler) -> bool:
    """The writer's step, every FLUSH_SECONDS until the handler is closed or gone: its flush."""
    if handler.closed:
        return False
    try:
        handler.flush()
    except OSError:
        pass  # stdout is gone (a closed pipe): these lines have nowhere to go
    return True


def forget_in_child(handler: weakref.ref[StdoutHandler]) -> None:
    """In a forked child: no writer thread yet, and none of the parent's lines (the parent writes them)."""
    live = handler()
    if live is not None:
        live.pending = []
        live.writing = False


def configure(level: str = "INFO") -> None:
    """Send every log record to stdout as JSON (what wsgi.py and the gunicorn config use)."""
    handler = StdoutHandler()
    handler.setFormatter(JSONFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # The JSON lines show no process name: spare logging its lookup for every record (the Logging
    # HOWTO's "Optimization" flags). Thread and process ids stay: other formats use them (gunicorn's
    # own log lines, %(process)d, when it runs without deploy/gunicorn.conf.py).
    logging.logMultiprocessing = False


def new_request_id() -> str:
    """128 random bits in hex, as uuid4().hex looks.

    From `random` (seeded from os.urandom, and again in each forked process), not os.urandom:
    its system call releases the GIL, which costs a thread hand-off per request under gunicorn's
    threads. A request id names a request; it is not a secret.
    """
    return f"{random.getrandbits(128):032x}"


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
        "key_id": caller.key_id if caller else None,
        "client_ip": req.remote_addr,
    }
    log.handle(record)
