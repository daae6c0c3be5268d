"""Usage counts across two gunicorn instances on one database (two workers each): they add up
exactly; a worker killed with kill -9 loses at most its last batch, a SIGTERM loses nothing."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from petstore import db, keys
from tests.support.checks import Answer, burst, http_getter
from tests.support.servers import ACCESS_PID_FORMAT, Gunicorn, poll_until

FLUSH_SECONDS = 3.0
HTTP_TIMEOUT = 10.0
ACCESS_PETS = re.compile(r"access <(\d+)> 200 GET /v1/pets")


def counted(conn: db.Connection, key_id: int) -> int:
    """The key's requests in key_usage, all outcomes."""
    row = conn.execute(
        """
        select coalesce(sum(requests_2xx + requests_4xx + requests_429 + requests_5xx), 0)::bigint
               as requests
          from key_usage
         where key_id = %(key_id)s
        """,
        {"key_id": key_id},
    ).fetchone()
    assert row is not None
    return int(row["requests"])


def answered_by(server: Gunicorn, since: int) -> list[int]:
    """The worker pid of each 200 GET /v1/pets in the access log past byte `since`."""
    text = server.log_path.read_bytes()[since:].decode(errors="replace")
    return [int(pid) for pid in ACCESS_PETS.findall(text)]


def all_ok(answers: list[Answer]) -> int:
    assert all(answer.status == 200 for answer in answers), {a.status for a in answers}
    return len(answers)


def test_two_instances_add_up_a_kill_loses_one_batch_a_sigterm_nothing(
    database_url: str, redis_url: str, conn: db.Connection, tmp_path: Path
) -> None:
    key, row = keys.issue_key(conn, "enterprise", "usage", 1_000_000, 10_000_000)
    environ = {
        "DATABASE_URL": database_url,
        "RATELIMIT_STORAGE_URI": redis_url,
        "PETSTORE_USAGE_FLUSH_SECONDS": str(FLUSH_SECONDS),
        "GUNICORN_CMD_ARGS": f"--access-logfile - --access-logformat {ACCESS_PID_FORMAT}",
    }
    with ExitStack() as stack:
        first, second = (
            stack.enter_context(Gunicorn(environ, tmp_path / f"{name}.log", workers=2, threads=2))
            for name in ("first", "second")
        )
        for server in (first, second):
            server.wait_for_workers(answering=True)
        gets: list[Callable[[], Answer]] = [
            http_getter(server.url, key, HTTP_TIMEOUT) for server in (first, second)
        ]

        # Both instances, every worker: all of it in key_usage within a batch or two.
        sent = sum(all_ok(burst(get, 60, 6)) for get in gets)
        poll_until(lambda: counted(conn, row["id"]), lambda n: n == sent, 4 * FLUSH_SECONDS)
        assert counted(conn, row["id"]) == sent

        # Quiet for longer than a batch: nothing is pending anywhere. Then a burst on the first
        # instance, and one of its workers killed before its next batch.
        time.sleep(FLUSH_SECONDS + 1.0)
        assert counted(conn, row["id"]) == sent
        mark = first.log_path.stat().st_size
        started = time.monotonic()
        sent += all_ok(burst(gets[0], 40, 8))
        killed = first.worker_pids()[0]
        os.kill(killed, signal.SIGKILL)
        assert time.monotonic() - started < FLUSH_SECONDS, "too slow to kill mid-batch"
        in_its_batch = answered_by(first, mark).count(killed)
        assert in_its_batch > 0, "the killed worker served none of the burst"

        # The replacement worker and the rest serve on; then both instances stop (SIGTERM) at
        # once, their last batches unwritten: the stop writes them.
        first.wait_for_workers()
        sent += sum(all_ok(burst(get, 40, 8)) for get in gets)
        os.kill(second.pid, signal.SIGTERM)
        first.stop()
        second.stop()

    total = counted(conn, row["id"])
    lost = sent - total
    assert 0 <= lost <= in_its_batch, (sent, total, in_its_batch)
    # What the killed worker served since its last batch is lost, and nothing else.
    assert lost == in_its_batch, (sent, total, in_its_batch)
