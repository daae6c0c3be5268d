"""The library internals petstore/gunicorn_glue.py (gunicorn) and petstore/ratelimit/limiter.py
(flask-limiter) rely on: each override does its job, or fails here loudly."""

from __future__ import annotations

import inspect
import json
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import flask_limiter
import gunicorn.util
import pytest
from flask import Flask
from flask_limiter import Limiter
from gunicorn.config import Config
from gunicorn.glogging import Logger
from gunicorn.http import errors as http_errors
from gunicorn.sock import TCPSocket
from gunicorn.workers.gthread import ThreadWorker
from gunicorn.workers.sync import SyncWorker
from limits.strategies import FixedWindowRateLimiter, RateLimiter

from petstore import gunicorn_glue
from petstore.ratelimit import limiter as limiter_module
from petstore.ratelimit.limiter import PlanLimiter


def test_flask_limiter_is_the_version_the_overrides_were_checked_against() -> None:
    # A new version: re-read flask_limiter/_extension.py (init_app, _check_request_limit,
    # the `limiter` property) against petstore/ratelimit/limiter.py, then update this number.
    assert flask_limiter.__version__ == "4.1.1"


def test_the_attributes_the_overrides_use_exist() -> None:
    limiter = Limiter(lambda: "k", storage_uri="memory://", in_memory_fallback_enabled=True)
    limiter.init_app(Flask(__name__))
    for name in ("_storage_dead", "_limiter", "_fallback_limiter", "_in_memory_fallback_enabled"):
        assert hasattr(limiter, name), name
    assert limiter._storage_dead is False
    assert isinstance(limiter._limiter, RateLimiter)
    assert isinstance(limiter._fallback_limiter, RateLimiter)
    # The public `limiter` property picks the fallback while the storage is dead.
    limiter._storage_dead = True
    assert limiter.limiter is limiter._fallback_limiter
    limiter._storage_dead = False
    assert limiter.limiter is limiter._limiter
    assert "callable_name" in inspect.signature(Limiter._check_request_limit).parameters


def test_init_app_registers_three_hooks_and_plan_limiter_detaches_them() -> None:
    app = Flask(__name__)
    before = {name: list(hooks) for name, hooks in app.before_request_funcs.items()}
    plain = Limiter(lambda: "k", storage_uri="memory://")
    plain.init_app(app)
    registered = sum(len(hooks) for hooks in app.before_request_funcs.values())
    registered += sum(len(hooks) for hooks in app.after_request_funcs.values())
    registered += sum(len(hooks) for hooks in app.teardown_request_funcs.values())
    assert registered == 3, "flask-limiter's init_app registers other hooks now"

    ours = Flask(__name__)
    limiter = PlanLimiter(lambda: "k", storage_uri="memory://", in_memory_fallback_enabled=True)
    limiter.init_app(ours)
    assert not any(ours.before_request_funcs.values()), before
    assert not any(ours.after_request_funcs.values())
    assert not any(ours.teardown_request_funcs.values())
    assert isinstance(limiter.limiter, FixedWindowRateLimiter)


def test_a_failing_storage_counts_in_memory_until_it_answers_again() -> None:
    limiter = PlanLimiter(lambda: "k", storage_uri="memory://", in_memory_fallback_enabled=True)
    limiter.init_app(Flask(__name__))
    from limits import parse

    item = parse("2/minute")
    storage = limiter.storage
    real_incr, real_check = storage.incr, storage.check

    def down(*args: object, **kwargs: object) -> int:
        raise ConnectionError("storage down")

    storage.incr = down  # type: ignore[method-assign]
    storage.check = lambda: False  # type: ignore[method-assign]
    assert limiter.count((item,), "k")[0][0] and limiter.count((item,), "k")[0][0]
    assert not limiter.count((item,), "k")[0][0], "the fallback counts"
    assert limiter.storage_dead
    storage.incr, storage.check = real_incr, real_check  # type: ignore[method-assign]
    limiter.next_storage_check = 0.0
    assert limiter.count((item,), "k")[0][0]
    assert not limiter.storage_dead, "back on the storage once it answers"


def test_one_storage_error_sends_every_count_to_memory_asking_again_once_a_second(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What docs/usage.rst says: the first error moves all of the worker's counting (other keys'
    too) to memory; the storage is asked again at most once per STORAGE_RECHECK_SECONDS, not
    after growing delays."""
    limiter = PlanLimiter(lambda: "k", storage_uri="memory://", in_memory_fallback_enabled=True)
    limiter.init_app(Flask(__name__))
    from limits import parse

    item = parse("5/minute")
    storage = limiter.storage
    clock = [1000.0]
    monkeypatch.setattr(limiter_module.time, "monotonic", lambda: clock[0])
    asked: list[str] = []

    def down(*args: object, **kwargs: object) -> int:
        asked.append("incr")
        raise ConnectionError("storage down")

    def check() -> bool:
        asked.append("check")
        return False

    monkeypatch.setattr(storage, "incr", down)
    monkeypatch.setattr(storage, "check", check)
    assert limiter.count((item,), "key-a")[0][0]
    assert limiter.storage_dead and asked == ["incr"]

    for step in range(1, 4):  # every 0.25 s of the next second: another key, never the storage
        clock[0] = 1000.0 + step * limiter_module.STORAGE_RECHECK_SECONDS / 4
        assert limiter.count((item,), f"key-{step}")[0][0]
    assert asked == ["incr"], "a count in fallback asked the storage before the interval"

    for seconds in (1, 2, 3, 4):  # failing checks: one per interval, the same interval each time
        clock[0] = 1000.0 + seconds * limiter_module.STORAGE_RECHECK_SECONDS
        limiter.count((item,), "key-a")
        limiter.count((item,), "key-b")
    assert asked == ["incr"] + ["check"] * 4
    assert limiter.storage_dead


@pytest.fixture
def json_refusals(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """use_json_refusals() for one test; gunicorn's own write_error is put back afterwards."""
    monkeypatch.setattr(gunicorn.util, "write_error", gunicorn.util.write_error)
    gunicorn_glue.use_json_refusals()
    yield


def refuse(worker_class: type[Any], exc: BaseException) -> tuple[str, dict[str, str], Any]:
    """What a real worker of this class writes to its client for `exc`: status line, headers, body."""
    cfg = Config()
    worker = worker_class(0, 0, [], None, 30, cfg, Logger(cfg))
    server, client = socket.socketpair()
    with server, client:
        worker.handle_error(None, server, ("127.0.0.1", 5000), exc)
        server.close()
        received = b""
        while chunk := client.recv(65536):
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (h.partition(":") for h in lines)}
    return status_line, headers, json.loads(body)


# Each refusal gunicorn makes, as its parser raises it -> the status line and code the client gets.
REFUSALS: dict[str, tuple[Callable[[], BaseException], str, str]] = {
    "request-line": (
        lambda: http_errors.InvalidRequestLine("GET /v1/pets/\u0661"),
        "HTTP/1.1 400",
        "invalid_request",
    ),
    "header-value": (
        lambda: http_errors.InvalidHeader("X-Odd"),
        "HTTP/1.1 400",
        "invalid_request",
    ),
    "http-version": (
        lambda: http_errors.InvalidHTTPVersion("HTTP/2.0"),
        "HTTP/1.1 400",
        "invalid_request",
    ),
    "request-line-too-long": (
        lambda: http_errors.LimitRequestLine(9000, 8190),
        "HTTP/1.1 414",
        "uri_too_long",
    ),
    "too-many-headers": (
        lambda: http_errors.LimitRequestHeaders("limit request headers fields"),
        "HTTP/1.1 431",
        "headers_too_large",
    ),
    "transfer-coding": (
        lambda: http_errors.UnsupportedTransferCoding("gzip"),
        "HTTP/1.1 400",
        "invalid_request",
    ),
    "chunk-size": (
        lambda: http_errors.InvalidChunkSize(b"zz"),
        "HTTP/1.1 400",
        "invalid_request",
    ),
    "expectation": (
        lambda: http_errors.ExpectationFailed("bananas"),
        "HTTP/1.1 417",
        "expectation_failed",
    ),
    "gunicorn-itself": (
        lambda: RuntimeError("a bug"),
        "HTTP/1.1 500",
        "internal_error",
    ),
}


@pytest.mark.parametrize("worker_class", [ThreadWorker, SyncWorker], ids=["gthread", "sync"])
@pytest.mark.parametrize(
    ("make_error", "status_line", "code"), REFUSALS.values(), ids=REFUSALS.keys()
)
def test_gunicorn_refusals_are_the_error_json(
    json_refusals: None,
    worker_class: type[Any],
    make_error: Callable[[], BaseException],
    status_line: str,
    code: str,
) -> None:
    """Every refusal of the worker classes the config may choose is the Error JSON, never HTML."""
    got_line, headers, body = refuse(worker_class, make_error())
    status = int(status_line.split()[1])
    # The reason phrase is Python's (http.HTTPStatus), which differs between versions.
    assert got_line.split()[:2] == status_line.split()[:2]
    assert headers["content-type"] == "application/json"
    assert headers["connection"] == "close"
    assert len(headers["x-request-id"]) == 32
    assert set(body) == {"code", "message", "status"}
    assert (body["code"], body["status"]) == (code, status)
    # The client's bytes are never echoed back.
    assert "\u0661" not in body["message"] and "bananas" not in body["message"]


def test_without_the_override_gunicorn_answers_html(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: gunicorn's own answer, the one the override replaces, is an HTML page."""
    monkeypatch.setattr(gunicorn.util, "write_error", gunicorn_glue.GUNICORN_WRITE_ERROR)
    cfg = Config()
    worker = ThreadWorker(0, 0, [], None, 30, cfg, Logger(cfg))
    server, client = socket.socketpair()
    with server, client:
        worker.handle_error(None, server, ("127.0.0.1", 5000), http_errors.InvalidHeader("X"))
        server.close()
        received = client.recv(65536)
    assert b"Content-Type: text/html" in received


def test_a_changed_write_error_stops_the_override(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another signature of gunicorn.util.write_error: use_json_refusals refuses to guess."""

    def write_error(sock: Any, status_int: int, reason: str, mesg: str, extra: Any) -> None:
        raise AssertionError("never called")

    monkeypatch.setattr(gunicorn.util, "write_error", gunicorn.util.write_error)
    monkeypatch.setattr(gunicorn_glue, "GUNICORN_WRITE_ERROR", write_error)
    with pytest.raises(gunicorn_glue.InternalsChanged, match="write_error takes"):
        gunicorn_glue.use_json_refusals()
    assert gunicorn.util.write_error is not gunicorn_glue.write_error_json


def test_a_handle_error_that_no_longer_calls_write_error_stops_the_override(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """If Worker.handle_error stops calling util.write_error, the override would do nothing: stop."""
    monkeypatch.setattr(gunicorn.util, "write_error", gunicorn.util.write_error)
    monkeypatch.setattr(gunicorn_glue, "WRITE_ERROR_CALL", "util.write_html(client)")
    with pytest.raises(gunicorn_glue.InternalsChanged, match="no longer calls"):
        gunicorn_glue.use_json_refusals()


def test_gunicorn_builds_no_access_line_for_the_app_that_logs_its_own() -> None:
    """With a logging config, gunicorn's own Logger builds the access atoms; NoAccessLogger does not."""
    config = Config()
    config.set("logconfig_dict", {"version": 1, "disable_existing_loggers": False})
    built = []

    class Watched(gunicorn_glue.NoAccessLogger):
        def atoms(self, *args: Any) -> dict[str, Any]:
            built.append(args)
            return {}

    class Stock(Logger):  # type: ignore[misc]
        atoms = Watched.atoms

    for logger_class in (Stock, Watched):
        logger_class(config).access(None, None, {}, None)
    assert len(built) == 1, "gunicorn's own logger builds the atoms; ours does not"


def test_threads_failing_at_once_switch_to_the_fallback_once() -> None:
    """One switch, one warning, however many threads find the storage down together."""
    limiter = PlanLimiter(lambda: "k", storage_uri="memory://", in_memory_fallback_enabled=True)
    limiter.init_app(Flask(__name__))
    from limits import parse

    item = parse("100/minute")
    switches = []

    def switched() -> None:
        switches.append(1)
        time.sleep(0.01)  # as slow as a log line written to a pipe: other threads run meanwhile

    limiter.on_fallback = switched  # type: ignore[method-assign]
    start = threading.Barrier(8)

    def down(*args: object, **kwargs: object) -> int:
        time.sleep(0.01)  # every thread is inside the failing call at once
        raise ConnectionError("storage down")

    limiter.storage.incr = down  # type: ignore[method-assign]

    def count() -> bool:
        start.wait()
        return limiter.count((item,), "k")[0][0]

    with ThreadPoolExecutor(max_workers=8) as pool:
        counted = list(pool.map(lambda _: count(), range(8)))
    assert counted == [True] * 8, "each request counted in the fallback"
    assert switches == [1]


@pytest.fixture
def listener() -> Iterator[Any]:
    """A gunicorn listening socket on a free loopback port, closed at the end."""
    cfg = Config()
    sock = TCPSocket(("127.0.0.1", 0), cfg, Logger(cfg))
    yield sock
    sock.close()


def worker_on(worker_class: type[Any], listener: Any) -> Any:
    cfg = Config()
    return worker_class(0, 0, [listener], None, 30, cfg, Logger(cfg))


def test_a_stopping_thread_worker_stops_listening_once_its_poller_lets_go(listener: Any) -> None:
    worker = worker_on(gunicorn_glue.ThreadWorker, listener)
    worker.poller = selectors.DefaultSelector()
    worker.alive = True
    worker.set_accept_enabled(True)
    worker.set_accept_enabled(False)
    # Running, it leaves its listener open when it is full (worker_connections reached).
    assert listener.sock.fileno() != -1
    worker.set_accept_enabled(True)
    worker.alive = False  # what handle_exit does on SIGTERM; the loop then stops accepting
    worker.set_accept_enabled(False)
    assert listener.sock.fileno() == -1
    assert worker.poller.get_map() == {}
    # The end of gunicorn's run closes it again, harmlessly.
    worker.tmp.close()
    listener.close()


def test_a_sync_worker_stops_listening_on_sigterm_and_takes_a_lost_accept_for_its_cue(
    listener: Any,
) -> None:
    worker = worker_on(gunicorn_glue.SyncWorker, listener)
    address = listener.getsockname()
    worker.alive = True
    listener.setblocking(0)
    with pytest.raises(BlockingIOError):
        worker.accept(listener)  # nothing to accept: gunicorn's loop takes this in its stride
    worker.handle_exit(15, None)
    assert worker.alive is False
    assert listener.sock.fileno() == -1
    worker.accept(listener)  # the accept the signal overtook returns, so the loop can end
    # A request accepted before the signal is still served: its environ names the listener's
    # address (gunicorn's handle_request), which must not be EBADF now.
    assert listener.getsockname() == address
    worker.handle_exit(15, None)  # a second SIGTERM (at exit, say) finds them closed: no error
    assert listener.getsockname() == address
    worker.alive = True
    with pytest.raises(OSError):
        worker.accept(listener)  # a bad descriptor on a running worker is still an error
    worker.tmp.close()
