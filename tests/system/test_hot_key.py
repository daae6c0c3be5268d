"""One hot key past one Redis shard (issue 39, Targets): a business key at 100 requests/s, open
loop, over 2 gunicorn instances x 2 workers on one Redis, its Redis calls counted with MONITOR.

What each test asserts, by the issue's letters:

- (a) the hot key's counting-path calls (EVALSHA naming its windows) per request and per
  admitted request, and all its calls (strike flushes and housekeeping included) per request;
- (b) admitted requests per minute window, grouped by the X-RateLimit-Reset they carry, and per day;
- (c) each full minute window admits at least the limit less 2 x instances x workers;
- (d) a cold key at 2 requests/s: exactly one EVALSHA of the counting script per request;
- (e) Redis killed for 60 s under the same load: at most twice the limit in any minute, no 5xx,
  every answer fast.

The load runs for HOT_KEY_SECONDS (180 by default, as CI runs it); PETSTORE_TEST_HOT_KEY_SECONDS
makes it shorter while developing. The measured numbers are in the run's summary
(tests/support/reports.py), for bench/results/.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import io
import math
import os
import pkgutil
import re
import socket
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from petstore import db, keys
from petstore.ratelimit import storages
from tests.support import reports
from tests.support.checks import call, http_getter
from tests.support.redis_servers import RedisServer
from tests.support.servers import (
    LOOPBACK,
    Gunicorn,
    ServerFailed,
    Service,
    log_tail,
    pid_logging_gunicorn,
)

HOT_KEY_SECONDS = float(os.environ.get("PETSTORE_TEST_HOT_KEY_SECONDS", "180"))
HOT_RATE = 100.0
COLD_RATE = 2.0
INSTANCES = 2
WORKERS = 2
THREADS = 4
# The business plan (petstore/plans.py).
PER_MINUTE = 1_000
PER_DAY = 100_000
# (a): Redis calls the hot key may cost.
COUNTING_PER_REQUEST = 0.02
COUNTING_PER_ADMITTED = 0.10
ALL_PER_REQUEST = 0.10
# (c): a full window admits at least the limit less this (2 x instances x workers).
EARLY_REFUSALS = 2 * INSTANCES * WORKERS
# (e): Redis down this long, after this long of load (every worker hot, and every worker's
# heartbeat seen: they come every 10 s), and the load goes on this long after its restart.
OUTAGE_SECONDS = 60.0
WARM_SECONDS = 20.0
AFTER_OUTAGE_SECONDS = 10.0
# Redis down or not, no answer may take longer (a dead Redis refuses at once; a call is bounded
# by PETSTORE_REDIS_TIMEOUT): this bound catches hangs, it is no benchmark.
ANSWER_WITHIN = 2.0
# Unused tokens go back after PETSTORE_LEASE_IDLE_SECONDS (1 s by default) idle: the calls
# counted end this long after the load, and after the instances' exit.
IDLE_RETURN_SECONDS = 2.5
# X-RateLimit-Reset is whole seconds, rounded up: a window "ended inside the run" when its
# Reset is at most this long after the last request was sent.
RESET_ROUNDING = 2.0
# Reset values of one window that differ by less than this are the same window (the
# assertion then wants them within 1 s); windows are a minute apart.
SAME_WINDOW = 30.0
# Open loop: each request is sent at its time from a pool this large, whatever the answers.
CLIENTS = 64
HTTP_TIMEOUT = 10.0
# p99 of how late requests left against their schedule: later, the load was not open loop.
LATE_P99 = 0.5
ENVIRON = {
    # Budgets per IP that no test reaches, and bans that never land: the key's budget only.
    "PETSTORE_IP_LIMITS": "1000000/minute;10000000/day",
    "PETSTORE_BAN_THRESHOLD": "1000000",
    "PETSTORE_REDIS_TIMEOUT": "0.25",
}
ACCESS_LINE = re.compile(r"access <(\d+)> (\d{3}) GET /v1/")
# Where a command names a key's budget: its windows' storage keys (LIMITS:...key:<id>/...) and
# its strike counter (LIMITS:<strategy>/strikes/<id>[/<forgiven>]).
WINDOW_OF = re.compile(r"key:(\d+)/")
STRIKES_OF = re.compile(r"/strikes/(\d+)(?:/|$)")


# The Redis calls, seen through MONITOR ---------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """One command a Redis client sent (MONITOR's line: Redis's time, the client, the arguments)."""

    at: float
    client: str
    args: tuple[str, ...]

    @property
    def command(self) -> str:
        return self.args[0].upper() if self.args else ""

    @property
    def from_script(self) -> bool:
        """A command a Lua script ran inside its one EVALSHA: no call of a client."""
        return self.client == "lua"

    def named(self) -> tuple[set[int], set[int]]:
        """(ids of keys whose windows it names, ids of keys whose strikes it names)."""
        if self.command in ("SCRIPT", "FUNCTION"):
            return set(), set()
        # EVAL's second argument is the script's text, which may name anything.
        args = (
            self.args[2:]
            if self.command.startswith("EVAL") and self.command != "EVALSHA"
            else self.args[1:]
        )
        windows = {int(found) for arg in args for found in WINDOW_OF.findall(arg)}
        strikes = {int(found) for arg in args for found in STRIKES_OF.findall(arg)}
        return windows, strikes


MONITOR_LINE = re.compile(r"\+(\d+\.\d+) \[\d+ ([^\]]*)\] (.*)")
MONITOR_ARG = re.compile(r'"((?:[^"\\]|\\.)*)"')


def parse_monitor_line(line: str) -> Call | None:
    """A Call of one MONITOR line, None for any other line (its +OK)."""
    match = MONITOR_LINE.fullmatch(line)
    if match is None:
        return None
    at, client, rest = match.groups()
    return Call(float(at), client, tuple(MONITOR_ARG.findall(rest)))


class RedisMonitor(Service):
    """A MONITOR connection to a loopback Redis, read in a thread of its own: every command any
    client sends, in the order Redis runs them. marker() names a moment in that order."""

    def __init__(self, port: int, within: float = 10.0) -> None:
        self.port = port
        self.within = within
        self.calls: list[Call] = []
        self.lock = threading.Lock()
        self.sock: socket.socket | None = None
        self.thread: threading.Thread | None = None
        self.stopping = False
        # The connection ended before stop(): what came after it was not seen.
        self.cut = False

    def start(self) -> None:
        """Connect, send MONITOR, wait (bounded) for its +OK, then read on in a thread."""
        sock = socket.create_connection((LOOPBACK, self.port), timeout=self.within)
        self.sock = sock
        sock.sendall(b"MONITOR\r\n")
        reader = sock.makefile("rb")
        first = reader.readline()
        if first != b"+OK\r\n":
            raise ServerFailed(f"MONITOR answered {first!r}")
        sock.settimeout(None)  # stop() ends the blocking read by shutting the socket down
        self.thread = threading.Thread(target=self.read, args=(reader,), daemon=True)
        self.thread.start()

    def read(self, reader: io.BufferedReader) -> None:
        """Record every line until the connection ends."""
        try:
            for raw in reader:
                found = parse_monitor_line(raw.decode("utf-8", errors="replace").rstrip("\r\n"))
                if found is not None:
                    with self.lock:
                        self.calls.append(found)
        except OSError:
            pass
        if not self.stopping:
            self.cut = True

    def marker(self, name: str) -> int:
        """Send ECHO `name` on a connection of the test's own and wait (bounded) until MONITOR
        has shown it: every command sent before it has been read. Its index in `calls`."""
        with socket.create_connection((LOOPBACK, self.port), timeout=self.within) as sock:
            sock.sendall(f"ECHO {name}\r\n".encode())
            sock.recv(256)
        deadline = time.monotonic() + self.within
        while time.monotonic() < deadline:
            with self.lock:
                for index in range(len(self.calls) - 1, -1, -1):
                    found = self.calls[index]
                    if found.command == "ECHO" and found.args[1:] == (name,):
                        return index
            time.sleep(0.05)
        raise ServerFailed(f"MONITOR did not show ECHO {name} within {self.within} s")

    def between(self, first: int, last: int) -> list[Call]:
        """The clients' calls strictly between two markers (not those scripts ran inside)."""
        with self.lock:
            return [found for found in self.calls[first + 1 : last] if not found.from_script]

    def stop(self) -> None:
        """Close the connection and wait (bounded) for the reader; idempotent."""
        self.stopping = True
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            self.sock.close()
            self.sock = None
        if self.thread is not None:
            self.thread.join(timeout=self.within)
            self.thread = None


def script_sha(text: bytes) -> str:
    """The id EVALSHA names a Lua script by (its SHA1, as redis-py's register_script makes it)."""
    return hashlib.sha1(text, usedforsecurity=False).hexdigest()


def script_names() -> dict[str, str]:
    """The SHA1 of each Lua script in petstore.ratelimit's modules (upper-case names whose text
    calls redis), as EVALSHA names it: its name."""
    names: dict[str, str] = {}
    package = importlib.import_module("petstore.ratelimit")
    for module_info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"petstore.ratelimit.{module_info.name}")
        for name, value in vars(module).items():
            if not name.isupper() or not isinstance(value, str | bytes):
                continue
            text = value.encode() if isinstance(value, str) else value
            if b"redis.call" in text:
                names[script_sha(text)] = name
    return names


@dataclass
class Tally:
    """The calls that one key's budget cost: those naming its windows (EVALSHA: the counting
    path), its strikes, and the housekeeping that names no key (heartbeats)."""

    counting: int = 0
    windows_other: int = 0
    strikes: int = 0
    housekeeping: int = 0
    # Each kind of call, by name ("EVALSHA RESERVE_WINDOWS"), and where it counted.
    kinds: Counter[str] = field(default_factory=Counter)

    @property
    def own(self) -> int:
        """Every call naming the key."""
        return self.counting + self.windows_other + self.strikes

    @property
    def everything(self) -> int:
        """Every call naming the key, and every call naming no key."""
        return self.own + self.housekeeping


def kind_of(found: Call, scripts: Mapping[str, str]) -> str:
    """A call's name for the report: the command, and an EVALSHA's script by name."""
    if found.command == "EVALSHA" and len(found.args) > 1:
        return f"EVALSHA {scripts.get(found.args[1], found.args[1][:8])}"
    return found.command


def tally(calls: Sequence[Call], key_id: int, scripts: Mapping[str, str]) -> Tally:
    """What `key_id` cost among these calls (housekeeping: every call that names no key)."""
    result = Tally()
    for found in calls:
        windows, strikes = found.named()
        kind = kind_of(found, scripts)
        if key_id in windows:
            if found.command == "EVALSHA":
                result.counting += 1
            else:
                result.windows_other += 1
            result.kinds[kind] += 1
        elif key_id in strikes:
            result.strikes += 1
            result.kinds[f"{kind} (strikes)"] += 1
        elif not windows and not strikes:
            result.housekeeping += 1
            result.kinds[f"{kind} (housekeeping)"] += 1
    return result


# The load: open loop, round-robin over the instances ------------------------------------------


@dataclass
class Sample:
    """One request of the load: whose key, which instance, when it left, what came back."""

    who: str
    instance: int
    sent: float  # time.monotonic()
    wall: float  # time.time() when sent, to compare with X-RateLimit-Reset
    late: float  # seconds after its scheduled time
    elapsed: float = 0.0
    status: int = 0  # 0: no answer
    code: str = ""
    limit: int | None = None
    remaining: int | None = None
    reset: int | None = None
    retry_after: str | None = None
    error: str = ""

    @property
    def received(self) -> float:
        return self.sent + self.elapsed


def header_int(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() else None


class OpenLoad:
    """GET /v1/pets for each stream (who: key, requests/s) at fixed times whatever the answers
    (open loop), request i of a stream on instance i mod the instances, each on a new connection
    (so that every worker of an instance takes its share)."""

    def __init__(self, urls: Sequence[str], streams: Mapping[str, tuple[str, float]]) -> None:
        self.urls = list(urls)
        self.streams = dict(streams)
        self.samples: list[Sample] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()

    def send(self, who: str, key: str, instance: int, scheduled: float) -> None:
        sample = Sample(who, instance, time.monotonic(), time.time(), 0.0)
        sample.late = sample.sent - scheduled
        try:
            answer = call(
                self.urls[instance],
                "GET",
                "/v1/pets",
                headers={"Authorization": f"Bearer {key}", "Connection": "close"},
                timeout=HTTP_TIMEOUT,
            )
        except OSError as exc:
            sample.elapsed = time.monotonic() - sample.sent
            sample.error = repr(exc)
        else:
            sample.elapsed = answer.elapsed
            sample.status = answer.status
            if isinstance(answer.body, dict):
                sample.code = str(answer.body.get("code", ""))
            sample.limit = header_int(answer.header("X-RateLimit-Limit"))
            sample.remaining = header_int(answer.header("X-RateLimit-Remaining"))
            sample.reset = header_int(answer.header("X-RateLimit-Reset"))
            sample.retry_after = answer.header("Retry-After")
        with self.lock:
            self.samples.append(sample)

    def schedule(self, who: str, executor: ThreadPoolExecutor, start: float) -> None:
        key, rate = self.streams[who]
        number = 0
        while True:
            at = start + number / rate
            if self.stopping.wait(max(0.0, at - time.monotonic())):
                return
            executor.submit(self.send, who, key, number % len(self.urls), at)
            number += 1

    @contextmanager
    def running(self) -> Iterator[OpenLoad]:
        """Send through the with block; at its end, stop sending and wait for every answer
        (each bounded by HTTP_TIMEOUT)."""
        executor = ThreadPoolExecutor(max_workers=CLIENTS)
        start = time.monotonic()
        schedulers = [
            threading.Thread(target=self.schedule, args=(who, executor, start), daemon=True)
            for who in self.streams
        ]
        for scheduler in schedulers:
            scheduler.start()
        try:
            yield self
        finally:
            self.stopping.set()
            for scheduler in schedulers:
                scheduler.join(timeout=5)
            executor.shutdown(wait=True)

    def of(self, who: str) -> list[Sample]:
        """The samples of one stream, in the order they were sent."""
        with self.lock:
            return sorted((s for s in self.samples if s.who == who), key=lambda s: s.sent)


# Minute windows, by the X-RateLimit-Reset the answers carry ------------------------------------


@dataclass
class Window:
    """The answers of one minute window of the hot key (Resets within SAME_WINDOW s of each other)."""

    resets: Counter[tuple[int, int]]  # (instance, reset): answers
    admitted: list[Sample]
    refused: list[Sample]
    full: bool = False

    @property
    def reset(self) -> int:
        return min(reset for _instance, reset in self.resets)

    @property
    def spread(self) -> int:
        """How far apart the Reset values of this window are, across every instance (s)."""
        values = [reset for _instance, reset in self.resets]
        return max(values) - min(values)

    def row(self, first_wall: float) -> str:
        last = max((s.wall for s in self.admitted), default=self.reset - 60.0)
        return (
            f"{self.reset:>11} {self.reset - first_wall:>+8.1f} s {'yes' if self.full else 'no':>4} "
            f"{len(self.admitted):>8} {len(self.refused):>7} {self.spread:>6} s "
            f"{last - (self.reset - 60):>9.1f} s"
        )


WINDOW_HEADER = (
    f"{'reset':>11} {'vs start':>10} {'full':>4} {'admitted':>8} {'refused':>7} {'spread':>8} "
    f"{'last 200':>11}"
)


def windows_of(samples: Sequence[Sample]) -> list[Window]:
    """The answers that carry a Reset, grouped into minute windows, oldest first; each marked
    full when the load ran from its start to its end (within Reset's rounding)."""
    answered = sorted((s for s in samples if s.reset is not None), key=lambda s: s.reset or 0)
    windows: list[Window] = []
    last_reset: int | None = None
    for sample in answered:
        assert sample.reset is not None
        if last_reset is None or sample.reset - last_reset >= SAME_WINDOW:
            windows.append(Window(Counter(), [], []))
        last_reset = sample.reset
        window = windows[-1]
        window.resets[(sample.instance, sample.reset)] += 1
        (window.admitted if sample.status == 200 else window.refused).append(sample)
    if samples:
        first = min(s.wall for s in samples)
        last = max(s.wall for s in samples)
        for window in windows:
            started = max(reset for _instance, reset in window.resets) - 60
            window.full = started >= first - 1 and window.reset <= last + RESET_ROUNDING
    return windows


def phases(
    calls: Sequence[Call], key_id: int, windows: Sequence[Window], scripts: Mapping[str, str]
) -> Counter[str]:
    """The calls naming the key's windows, by kind and by when in its minute window Redis ran
    them: its first 2 s, later while it admitted, after its last 200, or outside every window
    the answers name (before the first, after the last: the exit's releases)."""
    found: Counter[str] = Counter()
    for each in calls:
        if key_id not in each.named()[0]:
            continue
        phase = "outside"
        for window in windows:
            start = window.reset - 60.0
            if start - 1 <= each.at < window.reset:
                # Redis's clock is this host's: compare with when the answers came.
                last = max((s.wall + s.elapsed for s in window.admitted), default=start)
                if each.at < start + 2:
                    phase = "first 2 s"
                elif each.at <= last:
                    phase = "admitting"
                else:
                    phase = "refusing"
                break
        found[f"{kind_of(each, scripts)} ({phase})"] += 1
    return found


def most_in_any_minute(samples: Sequence[Sample]) -> int:
    """The most 200s answered within any 60 s, whatever window they counted in."""
    times = sorted(s.received for s in samples if s.status == 200)
    most, first = 0, 0
    for last, moment in enumerate(times):
        while moment - times[first] > 60.0:
            first += 1
        most = max(most, last - first + 1)
    return most


def remaining_overstated(samples: Sequence[Sample], windows: Sequence[Window]) -> list[str]:
    """200s whose X-RateLimit-Remaining is more than can remain: at most the limit, less this
    request, less every 200 of its window answered before it was sent (those were spent then,
    whatever the concurrency)."""
    found = []
    for window in windows:
        received = sorted(s.received for s in window.admitted)
        for sample in window.admitted:
            before = sum(1 for moment in received if moment < sample.sent)
            assert sample.remaining is not None
            if sample.remaining > PER_MINUTE - 1 - before:
                found.append(
                    f"Remaining {sample.remaining} with {before} admitted before it was sent "
                    f"(instance {sample.instance}, reset {sample.reset})"
                )
    return found


def header_problems(samples: Sequence[Sample]) -> list[str]:
    """Answers whose X-RateLimit-* are not the minute's, or are untrue for their status: a 200
    shows 0 <= Remaining < the limit, a 429 (rate_limited) Remaining 0 and a Retry-After; both
    a Reset within the minute from when it was sent: the end of a window that began at most when
    the answer was made, rounded up to a whole second (CI saw a window begin 2 ms after the
    request that began it was sent, at x.999 s: Reset 61.0009 s after the send)."""
    problems = []
    for sample in samples:
        if sample.status not in (200, 429):
            continue
        if sample.limit != PER_MINUTE or sample.remaining is None or sample.reset is None:
            problems.append(f"X-RateLimit-* missing or not the minute's: {sample}")
        elif not sample.wall - 1 <= sample.reset <= math.ceil(sample.wall + sample.elapsed + 60):
            problems.append(f"Reset outside the minute from the request: {sample}")
        elif sample.status == 200 and not 0 <= sample.remaining < PER_MINUTE:
            problems.append(f"a 200 with Remaining {sample.remaining}: {sample}")
        elif sample.status == 429 and (
            sample.code != "rate_limited" or sample.remaining != 0 or not sample.retry_after
        ):
            problems.append(f"a 429 not rate_limited with Remaining 0 and Retry-After: {sample}")
    return problems


# The servers ----------------------------------------------------------------------------------


def issue(conn: db.Connection, label: str) -> tuple[str, int]:
    """A business key made as `petstore keys create --plan business` makes it: (secret, id)."""
    secret, row = keys.issue_key(conn, "business", label)
    key_id: int = row["id"]
    return secret, key_id


def instance(database_url: str, redis_url: str, log_path: Path) -> Gunicorn:
    """A gunicorn of WORKERS workers (not started) on this Redis, logging each request's worker pid."""
    return pid_logging_gunicorn(
        database_url, redis_url, log_path, ENVIRON, workers=WORKERS, threads=THREADS
    )


@contextmanager
def instances(
    database_url: str, redis_url: str, workdir: Path, warm_key: str
) -> Iterator[list[Gunicorn]]:
    """INSTANCES gunicorns, every worker booted; a few requests of `warm_key` on each, so that
    Redis holds the counting script before anything is measured (a first EVALSHA would be
    refused NOSCRIPT, loaded and sent again)."""
    with contextlib.ExitStack() as stack:
        servers = [
            stack.enter_context(instance(database_url, redis_url, workdir / f"gunicorn-{n}.log"))
            for n in range(INSTANCES)
        ]
        for server in servers:
            server.wait_for_workers(answering=True)
            get = http_getter(server.url, warm_key, HTTP_TIMEOUT)
            statuses = [get().status for _ in range(4)]
            assert statuses == [200] * 4, (statuses, server.log())
        yield servers


def served_per_worker(servers: Sequence[Gunicorn]) -> list[dict[int, int]]:
    """/v1 answers each worker of each instance served, from their access logs."""
    return [
        dict(Counter(int(pid) for pid, _status in ACCESS_LINE.findall(server.log_path.read_text())))
        for server in servers
    ]


def log_problems(servers: Sequence[Gunicorn]) -> list[str]:
    """Tracebacks in the instances' logs, and the switch to the in-memory fallback: with Redis up
    throughout, neither may happen."""
    problems = []
    for server in servers:
        text = server.log_path.read_text(errors="replace")
        if "Traceback" in text or "falling back" in text:
            problems.append(f"{server.log_path.name}:\n{log_tail(server.log_path, 60)}")
    return problems


def line_count(text: str, word: str) -> int:
    """How many lines of `text` hold `word`."""
    return sum(1 for line in text.splitlines() if word in line)


def percentile(values: Sequence[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))] if ordered else 0.0


def timing_line(samples: Sequence[Sample]) -> str:
    elapsed = [s.elapsed for s in samples if s.status]
    late = [s.late for s in samples]
    return (
        f"answers: p50 {statistics.median(elapsed) * 1000:.1f} ms, "
        f"p99 {percentile(elapsed, 0.99) * 1000:.1f} ms, max {max(elapsed) * 1000:.1f} ms; "
        f"sent late against the schedule: p99 {percentile(late, 0.99) * 1000:.1f} ms, "
        f"max {max(late) * 1000:.1f} ms"
    )


def statuses(samples: Sequence[Sample]) -> Counter[int]:
    return Counter(s.status for s in samples)


def ratio(part: int, whole: int) -> float:
    return part / whole if whole else float("inf")


# (a) to (d) -----------------------------------------------------------------------------------


def test_hot_key_costs_few_redis_calls_and_never_over_admits(
    database_url: str, conn: db.Connection, tmp_path: Path
) -> None:
    hot_key, hot_id = issue(conn, "hot")
    cold_key, cold_id = issue(conn, "cold")
    warm_key, _warm_id = issue(conn, "warm-up")
    scripts = script_names()
    incr_sha = script_sha(storages.INCR_WINDOWS)

    with (
        RedisServer(tmp_path / "redis") as redis_server,
        RedisMonitor(redis_server.port) as monitor,
    ):
        with instances(database_url, redis_server.url(), tmp_path, warm_key) as servers:
            first = monitor.marker("hot-key-test-start")
            load = OpenLoad(
                [server.url for server in servers],
                {"hot": (hot_key, HOT_RATE), "cold": (cold_key, COLD_RATE)},
            )
            with load.running():
                time.sleep(HOT_KEY_SECONDS)
            # Leases go back once idle; then at exit, which leaving this block makes.
            time.sleep(IDLE_RETURN_SECONDS)
            per_worker = served_per_worker(servers)
        last = monitor.marker("hot-key-test-end")
        calls = monitor.between(first, last)
        cut = monitor.cut
        problems_in_logs = log_problems(servers)

    hot, cold = load.of("hot"), load.of("cold")
    hot_statuses, cold_statuses = statuses(hot), statuses(cold)
    admitted = hot_statuses[200]
    hot_calls = tally(calls, hot_id, scripts)
    cold_calls = tally(calls, cold_id, scripts)
    cold_named = [found for found in calls if cold_id in found.named()[0] | found.named()[1]]
    windows = windows_of(hot)
    full = [window for window in windows if window.full]
    first_wall = min(s.wall for s in hot)
    overstated = remaining_overstated(hot, windows)
    most = max((len(window.admitted) for window in windows), default=0)
    least = min((len(window.admitted) for window in full), default=0)
    spread = max((window.spread for window in windows), default=0)
    cold_scripts = Counter(kind_of(found, scripts) for found in cold_named)
    # Each target of the issue, with what was measured: (met, line).
    targets = [
        (
            ratio(hot_calls.counting, len(hot)) <= COUNTING_PER_REQUEST,
            f"(a) counting-path calls per request {ratio(hot_calls.counting, len(hot)):.4f} "
            f"(at most {COUNTING_PER_REQUEST})",
        ),
        (
            ratio(hot_calls.counting, admitted) <= COUNTING_PER_ADMITTED,
            f"(a) counting-path calls per admitted {ratio(hot_calls.counting, admitted):.4f} "
            f"(at most {COUNTING_PER_ADMITTED})",
        ),
        (
            ratio(hot_calls.everything, len(hot)) <= ALL_PER_REQUEST,
            f"(a) all calls per request {ratio(hot_calls.everything, len(hot)):.4f} "
            f"(at most {ALL_PER_REQUEST})",
        ),
        (
            most <= PER_MINUTE and admitted <= PER_DAY,
            f"(b) most admitted in a minute window {most} (at most {PER_MINUTE}); "
            f"in the day {admitted} (at most {PER_DAY})",
        ),
        (spread <= 1, f"(b) Reset of one window across instances and workers: {spread} s apart"),
        (
            not overstated,
            f"(b) 200s showing more Remaining than can remain: {len(overstated)}"
            + (f", such as {overstated[0]}" if overstated else ""),
        ),
        (
            bool(full) and least >= PER_MINUTE - EARLY_REFUSALS,
            f"(c) least admitted in a full window {least}, of {len(full)} full "
            f"(at least {PER_MINUTE - EARLY_REFUSALS})",
        ),
        (
            len(cold_named) == len(cold) and set(cold_scripts) == {"EVALSHA INCR_WINDOWS"},
            f"(d) cold key: {len(cold)} requests, {len(cold_named)} calls: {dict(cold_scripts)}",
        ),
    ]

    lines = [
        f"a business key ({PER_MINUTE}/min) at {HOT_RATE:.0f}/s and one at {COLD_RATE:.0f}/s, "
        f"open loop, {HOT_KEY_SECONDS:.0f} s, {INSTANCES} gunicorn x {WORKERS} workers, one Redis",
        f"{'key':<5} {'requests':>8} {'200s':>6} {'429s':>6} {'other':>5} {'counting':>8} "
        f"{'/request':>8} {'/admitted':>9} {'all calls':>9} {'/request':>8}",
    ]
    for who, samples, found in (("hot", hot, hot_calls), ("cold", cold, cold_calls)):
        counted = statuses(samples)
        everything = found.everything if who == "hot" else found.own
        lines.append(
            f"{who:<5} {len(samples):>8} {counted[200]:>6} {counted[429]:>6} "
            f"{len(samples) - counted[200] - counted[429]:>5} {found.counting:>8} "
            f"{ratio(found.counting, len(samples)):>8.4f} "
            f"{ratio(found.counting, counted[200]):>9.4f} {everything:>9} "
            f"{ratio(everything, len(samples)):>8.4f}"
        )
    lines += [
        "(hot's all calls: those naming it, and housekeeping, which names no key; cold's: those naming it)",
        "hot key's calls: " + ", ".join(f"{k} {n}" for k, n in sorted(hot_calls.kinds.items())),
        "cold key's calls: " + ", ".join(f"{k} {n}" for k, n in sorted(cold_scripts.items())),
        "hot key's calls naming its windows, by the part of its minute window they came in: "
        + ", ".join(f"{k} {n}" for k, n in sorted(phases(calls, hot_id, windows, scripts).items())),
        f"minute windows of the hot key, by X-RateLimit-Reset (start of the load: {first_wall:.1f}):",
        WINDOW_HEADER,
        *(window.row(first_wall) for window in windows),
        f"requests per worker (access logs, warm-up included): {per_worker}",
        f"hot key {timing_line(hot)}",
        *(f"{'met' if met else 'MISSED'}: {line}" for met, line in targets),
    ]
    reports.add(
        "One hot key past one Redis shard (tests/system/test_hot_key.py, (a) to (d))", lines
    )
    print("\n".join(lines))

    assert not cut, "the MONITOR connection ended during the run: calls went unseen"
    assert problems_in_logs == [], "\n".join(problems_in_logs)
    failures = [s for s in [*hot, *cold] if s.status == 0]
    assert failures == [], failures[:5]
    assert set(hot_statuses) <= {200, 429}, hot_statuses
    assert percentile([s.late for s in [*hot, *cold]], 0.99) < LATE_P99, timing_line(hot)
    problems = header_problems([*hot, *cold])
    assert problems == [], problems[:5]

    assert cold_statuses == {200: len(cold)}, cold_statuses
    # (c) needs full windows: a run of HOT_KEY_SECONDS has this many, minus the one Reset's
    # rounding may leave out.
    assert len(full) >= int((HOT_KEY_SECONDS - RESET_ROUNDING) // 60), [
        w.row(first_wall) for w in windows
    ]
    # (a) to (d): every target missed, with its measured number (the report has them all).
    missed = [line for met, line in targets if not met]
    assert missed == [], missed
    assert all(found.command == "EVALSHA" and found.args[1] == incr_sha for found in cold_named)


# (e) Redis down -------------------------------------------------------------------------------


def test_hot_key_with_redis_down_admits_at_most_twice_the_limit(
    database_url: str, conn: db.Connection, tmp_path: Path
) -> None:
    hot_key, _hot_id = issue(conn, "hot")
    cold_key, _cold_id = issue(conn, "cold")
    warm_key, _warm_id = issue(conn, "warm-up")

    with (
        RedisServer(tmp_path / "redis") as redis_server,
        instances(database_url, redis_server.url(), tmp_path, warm_key) as servers,
    ):
        load = OpenLoad(
            [server.url for server in servers],
            {"hot": (hot_key, HOT_RATE), "cold": (cold_key, COLD_RATE)},
        )
        with load.running():
            time.sleep(WARM_SECONDS)
            killed = time.monotonic()
            redis_server.stop()
            time.sleep(OUTAGE_SECONDS)
            redis_server.start()
            restarted = time.monotonic()
            time.sleep(AFTER_OUTAGE_SECONDS)
        per_worker = served_per_worker(servers)
        logs = [server.log_path.read_text(errors="replace") for server in servers]

    hot, cold = load.of("hot"), load.of("cold")
    everything = [*hot, *cold]
    down = [s for s in hot if killed <= s.sent < restarted]
    most = most_in_any_minute(hot)
    windows = windows_of(hot)
    first_wall = min(s.wall for s in hot)
    slowest = max(everything, key=lambda s: s.elapsed)
    all_statuses = statuses(everything)
    targets = [
        (
            most <= 2 * PER_MINUTE,
            f"(e) most 200s within any 60 s {most} (at most {2 * PER_MINUTE})",
        ),
        (
            statuses(down)[200] >= PER_MINUTE // (INSTANCES * WORKERS),
            f"(e) admitted while Redis was down {statuses(down)[200]} "
            f"(at least one worker's share, {PER_MINUTE // (INSTANCES * WORKERS)})",
        ),
        (set(all_statuses) <= {200, 429}, f"(e) statuses {dict(all_statuses)}, no 5xx"),
        (
            slowest.elapsed < ANSWER_WITHIN,
            f"(e) slowest answer {slowest.elapsed:.3f} s (under {ANSWER_WITHIN} s)",
        ),
    ]
    lines = [
        f"the same load; Redis killed after {WARM_SECONDS:.0f} s, down {OUTAGE_SECONDS:.0f} s, "
        f"then {AFTER_OUTAGE_SECONDS:.0f} s more",
        f"hot key: {len(hot)} requests {dict(statuses(hot))}; "
        f"while Redis was down: {len(down)} requests {dict(statuses(down))}",
        f"cold key: {len(cold)} requests {dict(statuses(cold))}",
        f"most 200s of the hot key within any 60 s: {most} (at most {2 * PER_MINUTE})",
        "log lines: "
        + ", ".join(
            f"{word} {sum(line_count(log, word) for log in logs)}"
            for word in ("falling back", "recovered", "Traceback")
        ),
        f"minute windows of the hot key, by X-RateLimit-Reset (start of the load: {first_wall:.1f}):",
        WINDOW_HEADER,
        *(window.row(first_wall) for window in windows),
        f"requests per worker (access logs, warm-up included): {per_worker}",
        f"all {timing_line(everything)}",
        f"slowest: {slowest}",
        *(f"{'met' if met else 'MISSED'}: {line}" for met, line in targets),
    ]
    reports.add("One hot key, Redis down 60 s (tests/system/test_hot_key.py, (e))", lines)
    print("\n".join(lines))

    failures = [s for s in everything if s.status == 0]
    assert failures == [], failures[:5]
    # Before the outage, the headers are Redis's; meanwhile each worker counts its own share.
    problems = header_problems([s for s in everything if s.sent < killed])
    assert problems == [], problems[:5]
    missed = [line for met, line in targets if not met]
    assert missed == [], missed
    assert statuses(cold) == {200: len(cold)}, statuses(cold)
