"""The JSON log goes to stdout, as docs/deploying.rst and deploy/gunicorn.conf.py say."""

from __future__ import annotations

import json
import subprocess
import sys

from petstore import logs

PROGRAM = """
import logging
from petstore import logs
logs.configure("INFO")
logging.getLogger("petstore.test").info("hello")
"""


def test_configure_writes_json_lines_to_stdout_and_nothing_to_stderr() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=60
    )

    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    record = json.loads(done.stdout)
    assert (record["level"], record["logger"], record["message"]) == (
        "info",
        "petstore.test",
        "hello",
    )


def run_program(program: str) -> list[dict[str, object]]:
    """Run `program` after `logs.configure("INFO")`; its stdout as JSON records (stderr must be empty)."""
    prelude = "import logging, os, time\nfrom petstore import logs\nlogs.configure('INFO')\n"
    done = subprocess.run(
        [sys.executable, "-c", prelude + program], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    return [json.loads(line) for line in done.stdout.splitlines()]


def messages(records: list[dict[str, object]]) -> list[object]:
    return [record["message"] for record in records]


def test_info_lines_are_written_within_the_flush_interval_without_an_exit() -> None:
    # os._exit skips logging.shutdown: only the writer thread can have written the lines.
    records = run_program(
        "for n in range(3): logging.getLogger('t').info('line %d', n)\n"
        "time.sleep(logs.FLUSH_SECONDS * 5)\n"
        "os._exit(0)\n"
    )
    assert messages(records) == ["line 0", "line 1", "line 2"]


def test_a_warning_is_written_at_once_after_every_line_before_it() -> None:
    # No writer thread in time: only the warning itself can write both lines.
    records = run_program(
        "logs.FLUSH_SECONDS = 3600\n"
        "logging.getLogger('t').info('before')\n"
        "logging.getLogger('t').warning('the warning')\n"
        "os._exit(0)\n"
    )
    assert messages(records) == ["before", "the warning"]


def test_a_full_batch_is_written_at_once() -> None:
    records = run_program(
        "logs.FLUSH_SECONDS = 3600\n"
        "for n in range(logs.MAX_PENDING): logging.getLogger('t').info('%d', n)\n"
        "os._exit(0)\n"
    )
    assert messages(records) == [str(n) for n in range(logs.MAX_PENDING)]


def test_pending_lines_are_written_at_a_normal_exit() -> None:
    records = run_program("logging.getLogger('t').info('last words')\n")
    assert messages(records) == ["last words"]


def test_a_forked_child_writes_its_own_lines_and_not_its_parents() -> None:
    records = run_program(
        "logging.getLogger('t').info('parent, before the fork')\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    logging.getLogger('t').info('child')\n"
        "    time.sleep(logs.FLUSH_SECONDS * 5)\n"
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "logging.getLogger('t').info('parent, after the child')\n"
    )
    assert sorted(messages(records)) == sorted(
        ["parent, before the fork", "child", "parent, after the child"]
    )


def test_other_formats_still_get_the_process_and_thread_ids() -> None:
    """gunicorn's own lines (run without deploy/gunicorn.conf.py) format %(process)d."""
    records = run_program(
        "import io\n"
        "written = io.StringIO()\n"
        "handler = logging.StreamHandler(written)\n"
        "handler.setFormatter(logging.Formatter('[%(process)d] [%(thread)d] %(message)s'))\n"
        "logging.getLogger('gunicorn.error').addHandler(handler)\n"
        "logging.getLogger('gunicorn.error').propagate = False\n"
        "logging.getLogger('gunicorn.error').info('Booting worker')\n"
        "assert written.getvalue().startswith(f'[{os.getpid()}] ['), written.getvalue()\n"
        "logging.getLogger('t').info('after')\n"
    )
    assert messages(records) == ["after"]
