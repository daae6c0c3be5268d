"""The JSON log goes to stdout, as README.rst and deploy/gunicorn.conf.py say."""

from __future__ import annotations

import json
import subprocess
import sys

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
