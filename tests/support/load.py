"""A mixed load of creates (retried with their Idempotency-Key), lists and gets, counted answer by answer."""

from __future__ import annotations

import math
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from petstore import db
from tests.support.checks import Answer, call

CLIENTS = 16
HTTP_TIMEOUT = 15.0
# A create retried for this long without a 201 is given up (MixedLoad.abandoned).
CREATE_DEADLINE = 20.0


def summarise(tries: list[tuple[float, str]]) -> str:
    """Tries as runs of one outcome: "503 x12 at 0.0-5.1 s, 500 at 5.3 s"."""
    runs: list[tuple[str, int, float, float]] = []
    for sent, outcome in tries:
        if runs and runs[-1][0] == outcome:
            runs[-1] = (outcome, runs[-1][1] + 1, runs[-1][2], sent)
        else:
            runs.append((outcome, 1, sent, sent))
    return ", ".join(
        f"{outcome} at {first:.1f} s"
        if count == 1
        else f"{outcome} x{count} at {first:.1f}-{last:.1f} s"
        for outcome, count, first, last in runs
    )


class MixedLoad:
    """`clients` threads sending `total` requests: creates (Idempotency-Key, retried on 503 or no
    answer), lists and gets; every answer and every 201 recorded."""

    def __init__(
        self,
        base_url: str,
        key: str,
        label: str,
        clients: int = CLIENTS,
        create_deadline: float = CREATE_DEADLINE,
    ) -> None:
        self.clients = clients
        self.create_deadline = create_deadline
        self.base_url = base_url
        self.key = key
        self.label = label
        self.answers: list[Answer] = []
        self.failures: list[str] = []
        self.created: list[int] = []
        # Each create given up: its name and key, then what its tries got (summarised).
        self.abandoned: list[str] = []
        self.lock = threading.Lock()

    def send(self, method: str, path: str, **extra: Any) -> Answer | None:
        headers = {"Authorization": f"Bearer {self.key}", **extra.pop("headers", {})}
        try:
            answer = call(
                self.base_url, method, path, headers=headers, timeout=HTTP_TIMEOUT, **extra
            )
        except OSError as exc:
            with self.lock:
                self.failures.append(f"{method} {path}: {exc!r}")
            time.sleep(0.2)
            return None
        with self.lock:
            self.answers.append(answer)
        if answer.status == 503:
            time.sleep(0.2)
        return answer

    def create(self, name: str) -> None:
        """Create a pet; on a 503 or no answer, again with the same Idempotency-Key (bounded)."""
        headers = {"Idempotency-Key": uuid.uuid4().hex}
        body = {"name": name, "categoryId": 3, "status": "available"}
        began = time.monotonic()
        tries: list[tuple[float, str]] = []
        while time.monotonic() < began + self.create_deadline:
            sent = time.monotonic() - began
            answer = self.send("POST", "/v1/pets", headers=headers, json_body=body)
            tries.append((sent, "no answer" if answer is None else str(answer.status)))
            if answer is not None and answer.status == 201:
                with self.lock:
                    self.created.append(answer.body["id"])
                return
            if answer is not None and answer.status != 503:
                break
        with self.lock:
            self.abandoned.append(
                f"{name} (Idempotency-Key {headers['Idempotency-Key']}, first sent at "
                f"{time.time() - (time.monotonic() - began):.1f}): {summarise(tries)}"
            )

    def request(self, number: int) -> None:
        step = number % 3
        if step == 0 or not self.created:
            self.create(f"{self.label}-{number}")
        elif step == 1:
            self.send("GET", "/v1/pets?limit=20")
        else:
            self.send("GET", f"/v1/pets/{self.created[number % len(self.created)]}")

    def run(self, total: int, stop: threading.Event | None = None) -> None:
        """`total` requests (or until `stop` is set) from CLIENTS threads."""

        def client(start: int) -> None:
            for number in range(start, total, self.clients):
                if stop is not None and stop.is_set():
                    return
                self.request(number)

        with ThreadPoolExecutor(max_workers=self.clients) as executor:
            list(executor.map(client, range(self.clients)))

    @contextmanager
    def running(self, total: int = 10**9) -> Iterator[MixedLoad]:
        """`run` in a thread of its own through the with block: stopped, and waited for (at most
        a minute: a request is bounded by HTTP_TIMEOUT), when the block ends."""
        stop = threading.Event()
        runner = threading.Thread(target=self.run, args=(total, stop), daemon=True)
        runner.start()
        try:
            yield self
        finally:
            stop.set()
            runner.join(timeout=60)
        assert not runner.is_alive(), "the load did not stop within a minute"

    def rows(self, connect: Callable[[], db.Connection]) -> Counter[str]:
        """The stored pets of this load by name, read on a connection from `connect`."""
        with connect() as conn:
            rows = conn.execute(
                "select name from pets where name like %s", [f"{self.label}-%"]
            ).fetchall()
        return Counter(row["name"] for row in rows)


def versions(url: str) -> set[str]:
    """The versions that a few /healthz answer with (during a release both masters answer)."""
    found = set()
    for _ in range(8):
        try:
            answer = call(url, "GET", "/healthz", timeout=5)
        except OSError:
            continue
        if answer.status == 200:
            found.add(answer.body["version"])
    return found


def p99(answers: list[Answer]) -> float:
    """The 99th percentile of the answers' times (nan for none)."""
    times = sorted(answer.elapsed for answer in answers)
    return times[int(len(times) * 0.99)] if times else math.nan


@contextmanager
def under_load(url: str, key: str, label: str) -> Iterator[MixedLoad]:
    """A mixed load of 8 clients on `url` through the with block, from 2 s before it to 2 s after."""
    with MixedLoad(url, key, label, clients=8).running() as load:
        time.sleep(2)
        yield load
        time.sleep(2)


def assert_nothing_refused(
    load: MixedLoad,
    connect: Callable[[], db.Connection],
    release: tuple[float, float],
    what: str,
) -> None:
    """Print what the release (its start and end) cost; assert only 200s and 201s, no failure
    and no create given up, every 201 a row (read on a connection from `connect`), and a load
    during it."""
    started, finished = release
    statuses = {answer.status for answer in load.answers}
    during = [a for a in load.answers if started <= a.started <= finished]
    print(
        f"\n{what} took {finished - started:.1f} s; {len(load.answers)} answers, "
        f"{len(during)} during it, p99 during {p99(during) * 1000:.1f} ms, "
        f"statuses {sorted(statuses)}, {len(load.failures)} refused or unanswered, "
        f"{len(load.created)} created"
    )

    assert load.failures == []
    assert statuses <= {200, 201}, sorted(statuses)
    assert load.abandoned == []
    rows = load.rows(connect)
    assert sum(rows.values()) == len(load.created) and set(rows.values()) == {1}
    assert len(during) > 50
