"""gunicorn's internals, overridden in one module. Re-check each of these on every upgrade.

tests/app/test_overrides.py fails loudly when one of them is gone or has changed shape.

gunicorn: when it cannot parse a request (a request line, a header, a chunked body it refuses),
its worker's ``handle_error`` answers through ``gunicorn.util.write_error``, which writes an HTML
page. ``use_json_refusals()`` puts ``write_error_json`` in its place, so those refusals are the
Error JSON like every other answer, whatever the worker class. deploy/gunicorn.conf.py calls it.

gunicorn's logger: given a logging configuration (logconfig_dict), gunicorn builds the fields
of its access log line for every request even when no access log is wanted, then drops the
line. `NoAccessLogger` (deploy/gunicorn.conf.py's logger_class) skips it: the app writes its
own line (petstore.logs).

The other places that rely on a library's internals, each checked by a test of its own:

- petstore/ratelimit/limiter.py: flask-limiter's private attributes and hooks
  (tests/app/test_overrides.py);
- petstore/ratelimit/storages.py: the `limits` storages, subclassed, and their private state
  (tests/app/test_storages.py);
- petstore/metrics.py: the private bucket counters and sum of prometheus_client's Histogram
  (tests/app/test_metrics.py);

gunicorn's workers: a worker told to stop (SIGTERM) keeps its copy of the listening sockets open
until it exits, so the kernel goes on accepting connections that it will never serve, and resets
them when it goes. `SyncWorker` and `ThreadWorker` (deploy/gunicorn.conf.py's worker classes)
close it as soon as they stop accepting: with no other process listening, a new connection is
refused at once and nginx sends it, POSTs included, to another instance; during a release
(USR2), the new master's workers accept it.
"""

from __future__ import annotations

import errno
import inspect
import json
import signal
import uuid
from http import HTTPStatus
from typing import Any

import gunicorn.glogging
import gunicorn.util
import gunicorn.workers.base
import gunicorn.workers.gthread
import gunicorn.workers.sync

# What gunicorn refuses with (Worker.handle_error) -> what the client gets: the same codes and
# messages as nginx's own refusals (deploy/nginx/petstore.conf), so both layers answer alike.
# 501 is gunicorn's answer to an unknown Transfer-Encoding: the client's mistake, never a 5xx.
REFUSALS: dict[int, tuple[int, str, str]] = {
    400: (400, "invalid_request", "The request is malformed."),
    403: (403, "forbidden", "The request is forbidden."),
    414: (414, "uri_too_long", "The request URI is longer than the service accepts."),
    417: (417, "expectation_failed", "The service meets no expectation but 100-continue."),
    431: (
        431,
        "headers_too_large",
        "The request has more header fields, or longer ones, than the service accepts.",
    ),
    500: (500, "internal_error", "The service failed to handle the request."),
    501: (400, "invalid_request", "The Transfer-Encoding of the request is not supported."),
}

# gunicorn's own function, and the signature ours must keep: handle_error calls it positionally.
GUNICORN_WRITE_ERROR = gunicorn.util.write_error
WRITE_ERROR_PARAMETERS = ["sock", "status_int", "reason", "mesg"]
WRITE_ERROR_CALL = "util.write_error(client, status_int, reason, mesg)"


class InternalsChanged(RuntimeError):
    """The library no longer looks the way an override here relies on: stop, do not guess."""


def refusal(status_int: int) -> tuple[int, str, str]:
    """(status, code, message) the client gets for a refusal gunicorn makes with `status_int`."""
    if status_int in REFUSALS:
        return REFUSALS[status_int]
    if 400 <= status_int < 500:
        return status_int, "invalid_request", "The request is malformed."
    return REFUSALS[500]


def error_bytes(status_int: int) -> bytes:
    """A whole HTTP/1.1 answer with the Error JSON: what write_error_json sends."""
    status, code, message = refusal(status_int)
    body = (json.dumps({"code": code, "message": message, "status": status}) + "\n").encode()
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
        "Connection: close\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        # Like nginx's $request_id: no request was parsed to carry the client's own.
        f"X-Request-ID: {uuid.uuid4().hex}\r\n"
        "\r\n"
    )
    return head.encode("latin-1") + body


def write_error_json(sock: Any, status_int: int, reason: str, mesg: str) -> None:
    """gunicorn.util.write_error with the Error JSON for a body; `reason` and `mesg` are not sent.

    gunicorn's message quotes the client's bytes back; its own log line keeps it
    ("Invalid request from ip=...").
    """
    gunicorn.util.write_nonblock(sock, error_bytes(status_int))


def check_gunicorn() -> None:
    """Raise InternalsChanged unless gunicorn still answers refusals through util.write_error."""
    parameters = list(inspect.signature(GUNICORN_WRITE_ERROR).parameters)
    if parameters != WRITE_ERROR_PARAMETERS:
        raise InternalsChanged(
            f"gunicorn.util.write_error takes {parameters}, not {WRITE_ERROR_PARAMETERS}: "
            "review petstore/overrides.py against this gunicorn"
        )
    source = inspect.getsource(gunicorn.workers.base.Worker.handle_error)
    if WRITE_ERROR_CALL not in source:
        raise InternalsChanged(
            f"gunicorn's Worker.handle_error no longer calls {WRITE_ERROR_CALL}: "
            "review petstore/overrides.py against this gunicorn"
        )


def use_json_refusals() -> None:
    """Make gunicorn write the Error JSON where it wrote its HTML error page; idempotent.

    Called in the master (deploy/gunicorn.conf.py) before the workers fork, so every worker,
    of any worker class, inherits it.
    """
    check_gunicorn()
    gunicorn.util.write_error = write_error_json


class NoAccessLogger(gunicorn.glogging.Logger):  # type: ignore[misc]
    """gunicorn's logger with no access log: the app logs each request itself (petstore.logs).

    gunicorn's `access` builds a dict of about thirty fields for every request whenever
    logconfig_dict is set, accesslog or not, and hands it to a logger that drops it: about 15
    µs of CPU per request. Its error log (gunicorn.error) is untouched.
    """

    def access(self, resp: Any, req: Any, environ: Any, request_time: Any) -> None:
        """Nothing: no access line is wanted from gunicorn."""


def close_listeners(worker: Any) -> None:
    """Close the worker's own copy of each listening socket (the wrappers stay, now closed)."""
    for listener in worker.sockets:
        listener.sock.close()


class SyncWorker(gunicorn.workers.sync.SyncWorker):  # type: ignore[misc]
    """gunicorn's sync worker, which closes its listening sockets as soon as SIGTERM stops it.

    It serves one request at a time and checks `alive` after each, so the signal handler can
    close them at once: the worker's `wait` takes a closed socket for its cue to stop, and an
    `accept` the signal overtook (a bad descriptor, on a worker no longer alive) is the same cue.
    """

    def init_signals(self) -> None:
        super().init_signals()
        # gunicorn has the kernel restart a system call SIGTERM interrupts: a worker blocked
        # reading a slow request's body would run handle_exit only once the read returns, and
        # meanwhile the kernel queues new connections on the socket still open, to reset them
        # when it closes. Interrupted instead, the read is retried by Python itself (PEP 475)
        # after the handler has closed the sockets.
        signal.siginterrupt(signal.SIGTERM, True)

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        close_listeners(self)

    def accept(self, listener: Any) -> None:
        try:
            super().accept(listener)
        except OSError as exc:
            if exc.errno != errno.EBADF or self.alive:
                raise


class ThreadWorker(gunicorn.workers.gthread.ThreadWorker):  # type: ignore[misc]
    """gunicorn's gthread worker, which closes its listening sockets once it stops accepting.

    On SIGTERM its loop ends, takes the sockets off its poller (`set_accept_enabled(False)`),
    then serves what it has accepted for up to graceful_timeout. They are closed right there:
    not in the signal handler, where the loop may be about to accept on them (a closed socket
    there raised out of the loop and ended the worker without serving what it had accepted),
    and not before they leave the poller, which could not unregister a closed descriptor.
    """

    def set_accept_enabled(self, enabled: bool) -> None:
        super().set_accept_enabled(enabled)
        if not self.alive:
            close_listeners(self)
