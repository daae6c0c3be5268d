"""Measurement for `make bench`: the servers under test, wrk runs, and CPU accounting from /proc.

The servers are the test harness's gunicorn (tests/support/servers.py) started with the deploy
config; a Measure is what one wrk run saw, with the CPU the app, PostgreSQL, wrk and every other
process spent meanwhile.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The test harness's process helpers, shared with the system tests.
sys.path.insert(0, str(ROOT / "tests"))

from support.nginx import DeployedGunicorn  # noqa: E402
from support.servers import LOOPBACK  # noqa: E402

WRK_DIR = ROOT / "bench" / "wrk"
GUNICORN_CONFIG = "deploy/gunicorn.conf.py"
STARTED = time.monotonic()


def log(message: str) -> None:
    """Progress on stdout, with the seconds since start."""
    print(f"[{time.monotonic() - STARTED:5.0f}s] {message}", flush=True)


@dataclass(frozen=True)
class Scenario:
    """One wrk run: a script of bench/wrk/ and the path of its URL."""

    name: str
    script: str
    path: str
    writes: bool = False


@dataclass(frozen=True)
class Target:
    """A running server as wrk drives it."""

    port: int
    app_pids: list[int]
    wrk_env: dict[str, str]


@dataclass
class Measure:
    """What one wrk run measured, and the CPU spent meanwhile by the app, PostgreSQL, wrk, others."""

    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    errors: int
    app_cpu: float
    pg_cpu: float | None
    wrk_cpu: float
    other_cpu: float

    @property
    def rps(self) -> float:
        """Requests per second."""
        return self.requests / self.seconds if self.seconds else 0.0

    def per_request_us(self, cpu_seconds: float | None) -> float | None:
        """CPU seconds spread over the requests, in microseconds each."""
        if cpu_seconds is None or not self.requests:
            return None
        return cpu_seconds / self.requests * 1e6

    @property
    def app_us(self) -> float | None:
        """The server processes' CPU per request, µs."""
        return self.per_request_us(self.app_cpu)

    @property
    def pg_us(self) -> float | None:
        """The PostgreSQL backends' CPU per request, µs."""
        return self.per_request_us(self.pg_cpu)


def combined(measures: list[Measure]) -> Measure:
    """Several runs as one: counts and CPU summed, latencies the median of the runs'."""
    return Measure(
        requests=sum(m.requests for m in measures),
        seconds=sum(m.seconds for m in measures),
        p50_ms=statistics.median(m.p50_ms for m in measures),
        p99_ms=statistics.median(m.p99_ms for m in measures),
        errors=sum(m.errors for m in measures),
        app_cpu=sum(m.app_cpu for m in measures),
        pg_cpu=None
        if any(m.pg_cpu is None for m in measures)
        else sum(m.pg_cpu or 0 for m in measures),
        wrk_cpu=sum(m.wrk_cpu for m in measures),
        other_cpu=sum(m.other_cpu for m in measures),
    )


# --- wrk ---------------------------------------------------------------------------------------


def ensure_wrk() -> None:
    """Make sure wrk is there: installed from Debian's packages when missing and we are root."""
    if shutil.which("wrk"):
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        sys.exit("wrk is missing: install it (Debian: sudo apt-get install -y wrk) and run again")
    log("wrk is missing: apt-get update && apt-get install -y wrk")
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "wrk"]):
        subprocess.run(command, check=True, timeout=600, stdout=subprocess.DEVNULL)
    if not shutil.which("wrk"):
        sys.exit("apt-get installed no wrk")


def run_wrk(
    target: Target,
    scenario: Scenario,
    duration: int,
    connections: int,
    threads: int,
    pg_pids: list[int] | None = None,
) -> Measure:
    """Drive the server with wrk for `duration` seconds; what wrk measured and who spent CPU."""
    command = [
        "wrk",
        f"-t{min(threads, connections)}",
        f"-c{connections}",
        f"-d{duration}s",
        "--latency",
        "--timeout",
        "5s",
        "-s",
        scenario.script,
        f"http://{LOOPBACK}:{target.port}{scenario.path}",
    ]
    app_before = cpu_seconds(target.app_pids)
    pg_before = cpu_seconds(pg_pids or [])
    busy_before = machine_busy_seconds()
    wrk_before = children_cpu_seconds()
    with subprocess.Popen(
        command,
        cwd=WRK_DIR,
        env=target.wrk_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as wrk:
        try:
            stdout, stderr = wrk.communicate(timeout=duration + 60)
        except BaseException:  # a timeout, or Ctrl-C: leave no wrk behind, not even a zombie
            wrk.kill()
            wrk.wait()
            raise
    wrk_cpu = children_cpu_seconds() - wrk_before
    busy = machine_busy_seconds() - busy_before
    app_cpu = cpu_seconds(target.app_pids) - app_before
    pg_cpu = cpu_seconds(pg_pids or []) - pg_before
    summary = [line[6:] for line in stdout.splitlines() if line.startswith("BENCH ")]
    if wrk.returncode != 0 or not summary:
        raise RuntimeError(f"wrk failed ({wrk.returncode}):\n{stdout}\n{stderr}")
    numbers = json.loads(summary[0])
    return Measure(
        requests=numbers["requests"],
        seconds=numbers["duration_us"] / 1e6,
        p50_ms=numbers["p50_us"] / 1e3,
        p99_ms=numbers["p99_us"] / 1e3,
        errors=sum(numbers[kind] for kind in ("connect", "read", "write", "status", "timeout")),
        app_cpu=app_cpu,
        pg_cpu=pg_cpu if pg_pids else None,
        wrk_cpu=wrk_cpu,
        other_cpu=max(0.0, busy - app_cpu - pg_cpu - wrk_cpu),
    )


# --- /proc -------------------------------------------------------------------------------------


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds spent so far by these processes (gone ones count 0)."""
    ticks = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine has spent not idle since boot."""
    fields = [int(each) for each in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    """CPU seconds of our finished children (wrk, once it has been waited for)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def peak_rss_kib(pid: int) -> int:
    """VmHWM of a process: its peak resident set size, in KiB."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


# --- the servers -------------------------------------------------------------------------------


def get(port: int, path: str, key: str | None = None) -> tuple[int, dict[str, str], bytes]:
    """GET a path of a server: status, headers, body."""
    connection = http.client.HTTPConnection(LOOPBACK, port, timeout=5)
    try:
        connection.request("GET", path, headers={"Authorization": f"Bearer {key}"} if key else {})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


class BenchGunicorn(DeployedGunicorn):
    """The harness's deployed gunicorn (deploy/gunicorn.conf.py), serving an app of our choice.

    `environ` is the whole environment (the runner leaves out the caller's service settings);
    ready when /healthz answers and every worker is up.
    """

    def __init__(
        self, app: list[str], environ: Mapping[str, str], log_path: Path, workers: int, threads: int
    ) -> None:
        super().__init__(
            environ,
            log_path,
            workers=workers,
            threads=threads,
            start_timeout=30.0,
            stop_timeout=30.0,
        )
        self.app = app

    def command(self) -> list[str]:
        """gunicorn with the deploy config; workers, threads and class come from the environment."""
        return [sys.executable, "-m", "gunicorn", "-c", GUNICORN_CONFIG, *self.app]

    def start(self) -> None:
        """Start it with exactly `environ`, and wait (bounded) until every worker is up."""
        self.launch(self.command(), cwd=ROOT, env={**self.environ, "PYTHONUNBUFFERED": "1"})

    def answers(self) -> bool:
        """/healthz answers 200 and the master has all its workers."""
        return super().answers() and len(self.worker_pids()) == self.workers
