"""gunicorn's glue, named in deploy/gunicorn.conf.py: the Error JSON for its refusals, no access
log of its own, and workers that stop listening as soon as they stop. Each overrides gunicorn's
internals: re-check them on every upgrade (tests/app/test_overrides.py fails loudly when one is
gone or has changed shape).

The other uses of a library's internals, each checked by a test: petstore/ratelimit/limiter.py
(flask-limiter's private attributes and hooks: tests/app/test_overrides.py),
petstore/ratelimit/storages.py (the `limits` storages, subclassed: tests/app/test_storages.py),
petstore/metrics.py (prometheus_client's Histogram buckets and sum: tests/app/test_metrics.py).
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


def error_bytes(status_int: int) -> bytes:
    """A whole HTTP/1.1 answer with the Error JSON: what write_error_json sends (for a status
    REFUSALS does not list, a 4xx is invalid_request, anything else internal_error)."""
    other = (status_int, *REFUSALS[400][1:]) if 400 <= status_int < 500 else REFUSALS[500]
    status, code, message = REFUSALS.get(status_int, other)
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
    """gunicorn.util.write_error with the Error JSON for a body; not `mesg`, which quotes the
    client's bytes back (gunicorn's own log line keeps it)."""
    gunicorn.util.write_nonblock(sock, error_bytes(status_int))


def check_gunicorn() -> None:
    """Raise InternalsChanged unless gunicorn still answers refusals through util.write_error."""
    parameters = list(inspect.signature(GUNICORN_WRITE_ERROR).parameters)
    if parameters != WRITE_ERROR_PARAMETERS:
        changed = f"gunicorn.util.write_error takes {parameters}, not {WRITE_ERROR_PARAMETERS}"
    elif WRITE_ERROR_CALL not in inspect.getsource(gunicorn.workers.base.Worker.handle_error):
        changed = f"gunicorn's Worker.handle_error no longer calls {WRITE_ERROR_CALL}"
    else:
        return
    raise InternalsChanged(f"{changed}: review petstore/gunicorn_glue.py against this gunicorn")


def use_json_refusals() -> None:
    """Make gunicorn answer a request it cannot parse (Worker.handle_error) with the Error JSON,
    not its HTML page; idempotent. Called in the master before the workers fork, so every worker,
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
    """Close the worker's own copy of each listening socket (the wrappers stay, now closed).

    Left open until the worker exits, the kernel would go on accepting connections there that it
    never serves, and reset them; closed, with no other process listening, a new connection is
    refused at once and nginx sends it, POSTs included, to another instance (during a release,
    USR2, the new master's workers accept it).

    A request the worker accepted before is still served: gunicorn builds its environ from
    `listener.getsockname()` (the sync worker after the signal, in handle_request), which the
    wrapper then answers with the address it had, not EBADF (CI saw that POST cut short).
    """
    for listener in worker.sockets:
        if listener.sock.fileno() == -1:
            continue  # closed already: a second SIGTERM
        address = listener.sock.getsockname()
        listener.sock.close()
        listener.getsockname = lambda address=address: address


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
    not in the signal handler, where a closed socket would raise out of a loop about to accept
    on it (ending the worker before it served what it had accepted), and not before they leave
    the poller, which could not unregister a closed descriptor.
    """

    def set_accept_enabled(self, enabled: bool) -> None:
        super().set_accept_enabled(enabled)
        if not self.alive:
            close_listeners(self)
